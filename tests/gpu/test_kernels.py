"""The CUDA kernels against their torch references, on the GPU, byte for byte.

- pack (bf16/fp16 concat, fp8-quantizing concat) on strided views of a real
  kv_b_proj output and of the workspace, T in {0, 1, 3, 4097, 65536}, H in
  {1, 3, 4, 16, 128}, k_pe in the input dtype or fp8;
- the fp8 cast on ALL 65,536 bf16 and ALL 65,536 fp16 bit patterns against
  ``x.clamp(-448, 448).to(float8_e4m3fn)`` computed on the GPU (non-NaN bytes equal,
  NaN in -> NaN out);
- gather (every cache dtype / out dtype) with random block tables, partial blocks,
  continuation starts and zero-length sequences; insert with large values, +-inf,
  NaN, subnormals, zero and all-non-finite tiles, -1 slots, fp32 and bf16 inputs;
- merge with -inf / +inf / both-empty rows and strided (transposed-storage) LSEs.

Equality is on the bytes. The only relaxation: a NaN equals any NaN (the sign and
payload of a NaN are not part of the contract, CONTRACT §6).

One known difference that is torch's, not the kernel's: torch on CUDA computes
``tensor / python_scalar`` as ``tensor * (1 / scalar)`` (pytorch/pytorch#191495), so
``insert_reference`` on CUDA rounds ``x / k_scale`` differently from IEEE division for
some k_scale that are not powers of two. The kernel divides (CONTRACT §2: ``x /
k_scale``), which equals the reference run on the CPU; the CUDA-reference comparison
for such a k_scale is reported as an xfail when they differ.
"""

from __future__ import annotations

import math

import pytest
import torch

from ctxprefill.ops import gather as gather_op
from ctxprefill.ops import insert as insert_op
from ctxprefill.ops import merge as merge_op
from ctxprefill.ops import pack as pack_op
from ctxprefill.ops.gather import gather_reference
from ctxprefill.ops.insert import insert_reference
from ctxprefill.ops.merge import merge_reference
from ctxprefill.ops.pack import (
    fused_mla_kv_concat_quant_fp8_reference,
    fused_mla_kv_concat_reference,
    generic_kv_concat,
    generic_kv_concat_quant_fp8,
)
from ctxprefill.ops.slot_format import bytes_per_slot

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the CUDA kernel tests run on the GPU machine")]

DEV = "cuda"
FP8 = torch.float8_e4m3fn
BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(autouse=True)
def _ext(cuda_ext):
    return cuda_ext


# ---- comparison helpers -------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def isnan(t: torch.Tensor) -> torch.Tensor:
    return t.float().isnan() if t.dtype != torch.uint8 else torch.zeros_like(t, dtype=torch.bool)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bytes; NaN equals NaN (any sign or payload)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    na, nb = isnan(got), isnan(want)
    if not torch.equal(na, nb):
        idx = (na != nb).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: NaN positions differ ({int((na != nb).sum())} places, e.g. {idx})")
    diff = (bits(got) != bits(want)) & ~na
    n = int(diff.sum())
    if n:
        gb, wb = bits(got), bits(want)
        ex = [(tuple(i), gb[tuple(i)].item(), wb[tuple(i)].item(), want[tuple(i)].float().item())
              for i in diff.nonzero()[:8].tolist()]
        raise AssertionError(f"{what}: {n} of {got.numel()} elements differ; (index, got bits, want bits, want) {ex}")


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Exactly the same bytes, NaN payloads included (raw copies)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    n = int((bits(got) != bits(want)).sum())
    assert n == 0, f"{what}: {n} of {got.numel()} elements differ"


def slots_same(got: torch.Tensor, want: torch.Tensor, cache_dtype: str, what: str = "") -> None:
    """Compare cache slot bytes field by field (so that NaN equals NaN)."""
    assert got.shape == want.shape
    if cache_dtype == "auto":
        assert_same(got.contiguous().view(BF16), want.contiguous().view(BF16), f"{what} bf16 slots")
    elif cache_dtype == "fp8":
        assert_same(got.contiguous().view(FP8), want.contiguous().view(FP8), f"{what} fp8 slots")
    else:
        assert_same(got[:, :512].contiguous().view(FP8), want[:, :512].contiguous().view(FP8), f"{what} ds_mla values")
        assert_bits_equal(got[:, 512:528], want[:, 512:528], f"{what} ds_mla tile scales")
        assert_same(got[:, 528:].contiguous().view(BF16), want[:, 528:].contiguous().view(BF16), f"{what} ds_mla k_pe")


def sat_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(FP8)


# ---- pack -------------------------------------------------------------------------------------

TS = [0, 1, 3, 4097, 65536]
HS = [1, 3, 4, 16, 128]


def pack_inputs(T: int, H: int, dtype: torch.dtype, pe_fp8: bool = False, seed: int = 0):
    """k_nope, v: the strided halves of a real kv_b_proj output ``(x @ W.T).view(T,H,256)``;
    k_pe: the ``[:, 512:]`` view of a [T, 576] workspace. Every other head is scaled
    past the fp8 range so that the saturation is exercised too."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn((T, 512), device=DEV, generator=g).to(dtype)
    w = torch.randn((H * 256, 512), device=DEV, generator=g) / math.sqrt(512)
    w = w * torch.where(torch.arange(H, device=DEV) % 2 == 1, 300.0, 1.0).repeat_interleave(256)[:, None]
    kv = (x @ w.to(dtype).t()).view(T, H, 256)
    k_nope, v = kv[..., :128], kv[..., 128:]
    ws = torch.randn((T, 576), device=DEV, generator=g) * 200
    ws = sat_fp8(ws) if pe_fp8 else ws.to(dtype)
    return k_nope, ws[:, 512:], v


def _skip_huge(T, H):
    if T * H * 256 * 2 * 4 > torch.cuda.get_device_properties(0).total_memory // 2:
        pytest.skip(f"T={T}, H={H} needs more than half the GPU memory")


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("T", TS)
def test_kv_concat(cuda_ext, T, H, dtype):
    _skip_huge(T, H)
    k_nope, k_pe, v = pack_inputs(T, H, dtype)
    assert k_nope.stride() == (H * 256, 256, 1) and k_pe.stride() == (576, 1)
    got = cuda_ext.fused_mla_kv_concat(k_nope, k_pe)
    assert got.is_contiguous() and got.shape == (T, H, 192) and got.dtype == dtype
    assert_bits_equal(got, fused_mla_kv_concat_reference(k_nope, k_pe), "fused vs reference")
    assert_bits_equal(got, generic_kv_concat(k_nope, k_pe), "fused vs generic (torch.cat)")
    # the public op dispatches to the kernel ([T, 1, 64] k_pe accepted too)
    assert_bits_equal(pack_op.fused_mla_kv_concat(k_nope, k_pe[:, None, :]), got, "public op")


@pytest.mark.parametrize("pe", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("T", TS)
def test_kv_concat_quant_fp8(cuda_ext, T, H, dtype, pe):
    _skip_huge(T, H)
    k_nope, k_pe, v = pack_inputs(T, H, dtype, pe_fp8=pe == "fp8")
    k8, v8 = cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)
    assert k8.dtype == FP8 and v8.dtype == FP8 and k8.is_contiguous() and v8.is_contiguous()
    assert k8.shape == (T, H, 192) and v8.shape == (T, H, 128)
    rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v)
    assert_same(k8, rk, "k fused vs reference")
    assert_same(v8, rv, "v fused vs reference")
    gk, gv = generic_kv_concat_quant_fp8(k_nope, k_pe, v)
    assert_same(k8, gk, "k fused vs generic")
    assert_same(v8, gv, "v fused vs generic")
    pk, pv = pack_op.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)
    assert_bits_equal(pk, k8, "public op k")
    assert_bits_equal(pv, v8, "public op v")


def _segments(T: int, kind: str) -> list[int]:
    """cu_seqlens over T tokens: one segment, or ragged ones (empty, 1 token, unaligned)."""
    if kind == "one" or T == 0:
        return [0, T]
    cuts = sorted({0, T, min(T, 1), min(T, 17), T // 3, T // 3, T // 2 + 5 if T > 10 else T})
    return [c for c in cuts if 0 <= c <= T] if T > 1 else [0, 0, T]


@pytest.mark.parametrize("segs", ["one", "ragged"])
@pytest.mark.parametrize("pe", ["same", "fp8"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("T", [1, 3, 4097, 65536])
def test_kv_concat_quant_fp8_keys_last(cuda_ext, T, H, dtype, pe, segs):
    """V keys-last ([H, 128, v_cols], each segment from a 16-aligned column, zeros
    between): byte-identical to the reference and the generic path; k as row-major."""
    _skip_huge(T, H)
    k_nope, k_pe, v = pack_inputs(T, H, dtype, pe_fp8=pe == "fp8")
    cu = _segments(T, segs)
    layout = pack_op.keys_last_layout(cu, DEV)
    k8, vt = cuda_ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, layout.cu_k_dev, layout.cu_v_dev,
                                                       layout.v_cols)
    assert k8.shape == (T, H, 192) and vt.shape == (H, 128, layout.v_cols) and vt.is_contiguous()
    # K's rows past its end (attention that loads whole 16-key groups reads them)
    assert k8.is_contiguous() and pack_op.rows_readable(k8) == T + pack_op.KEY_SLACK_ROWS
    rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v, layout)
    assert_same(k8, rk, "k fused vs reference")
    assert_same(vt, rv, "v keys-last fused vs reference")
    assert_same(k8, cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)[0], "k as the row-major kernel")
    gk, gv = generic_kv_concat_quant_fp8(k_nope, k_pe, v, v_keys_last=layout)
    assert_same(vt, gv, "v keys-last fused vs generic")
    # the layout itself: segment s's keys at columns cu_v[s].., zeros elsewhere
    v8 = sat_fp8(v)
    for a, b, c in zip(layout.cu_k, layout.cu_k[1:], layout.cu_v):
        assert_same(vt[:, :, c : c + b - a], v8[a:b].permute(1, 2, 0), f"segment at column {c}")
    pk, pv = pack_op.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v, v_keys_last=layout)
    assert_bits_equal(pk, k8, "public op k")
    assert_bits_equal(pv, vt, "public op v")


def test_pack_keys_last_unaligned_and_errors(cuda_ext):
    T, H = 37, 3
    base = torch.randn((T, H, 261), device=DEV).mul(100).to(BF16)  # head stride 261: unaligned
    k_nope, v = base[..., 1:129], base[..., 133:261]
    k_pe = torch.randn((T, 579), device=DEV).mul(100).to(BF16)[:, 515:]
    cu = [0, 5, 5, 22, 37]
    layout = pack_op.keys_last_layout(cu, DEV)
    k8, vt = cuda_ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, layout.cu_k_dev, layout.cu_v_dev,
                                                       layout.v_cols)
    rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v, layout)
    assert_same(k8, rk, "unaligned k")
    assert_same(vt, rv, "unaligned v keys-last")
    with pytest.raises(RuntimeError, match="v_cols"):
        cuda_ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, layout.cu_k_dev, layout.cu_v_dev, 40)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cuda_ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, layout.cu_k_dev, layout.cu_v_dev[:2],
                                                  layout.v_cols)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cuda_ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, k_pe, v, layout.cu_k_dev.long(), layout.cu_v_dev,
                                                  layout.v_cols)
    with pytest.raises(ValueError, match="covers tokens"):
        pack_op.fused_mla_kv_concat_quant_fp8(k_nope[:30], k_pe[:30], v[:30], v_keys_last=layout)


def test_pack_unaligned_fallback(cuda_ext):
    """Row strides that break 16-byte alignment take the byte-wise kernels: same bytes."""
    T, H = 37, 3
    for dtype in (BF16, FP16):
        base = torch.randn((T, H, 261), device=DEV).mul(100).to(dtype)  # head stride 261: unaligned
        k_nope, v = base[..., 1:129], base[..., 133:261]
        ws = torch.randn((T, 579), device=DEV).mul(100).to(dtype)
        k_pe = ws[:, 515:]
        assert_bits_equal(cuda_ext.fused_mla_kv_concat(k_nope, k_pe), fused_mla_kv_concat_reference(k_nope, k_pe))
        k8, v8 = cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)
        rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v)
        assert_same(k8, rk, "unaligned k")
        assert_same(v8, rv, "unaligned v")
        ws8 = sat_fp8(torch.randn((T, 577), device=DEV) * 100)
        k8, v8 = cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, ws8[:, 513:], v)
        rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, ws8[:, 513:], v)
        assert_same(k8, rk, "unaligned fp8 k_pe")


def test_pack_empty_and_errors(cuda_ext):
    k_nope, k_pe, v = pack_inputs(0, 16, BF16)
    assert cuda_ext.fused_mla_kv_concat(k_nope, k_pe).shape == (0, 16, 192)
    k8, v8 = cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)
    assert k8.shape == (0, 16, 192) and v8.shape == (0, 16, 128) and k8.dtype == FP8
    k_nope, k_pe, v = pack_inputs(4, 2, BF16)
    with pytest.raises(RuntimeError, match="k_pe"):
        cuda_ext.fused_mla_kv_concat(k_nope, k_pe.to(FP16))
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_ext.fused_mla_kv_concat(k_nope.cpu(), k_pe.cpu())
    with pytest.raises(RuntimeError, match="unit last stride"):
        cuda_ext.fused_mla_kv_concat(torch.zeros((4, 2, 128, 2), dtype=BF16, device=DEV)[..., 0], k_pe)
    with pytest.raises(RuntimeError, match="unit last stride"):
        cuda_ext.fused_mla_kv_concat(k_nope, k_pe.t().contiguous().t())


def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(DEV)


@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fp8_cast_all_bit_patterns(cuda_ext, dtype, H):
    """Every 16-bit pattern through k_nope, v and k_pe: the kernel's cast equals
    ``x.clamp(-448, 448).to(float8_e4m3fn)`` computed on the GPU."""
    pats = _all_patterns(dtype)  # 65,536 values
    T = 1024
    kv = torch.empty((T, H, 256), dtype=dtype, device=DEV)
    n = T * H * 128
    kv[..., :128] = pats.repeat(n // pats.numel()).view(T, H, 128)
    kv[..., 128:] = pats.flip(0).roll(7).repeat(n // pats.numel()).view(T, H, 128)
    ws = torch.zeros((T, 576), dtype=dtype, device=DEV)
    ws[:, 512:] = pats.roll(12345).view(T, 64)
    k_nope, v, k_pe = kv[..., :128], kv[..., 128:], ws[:, 512:]
    k8, v8 = cuda_ext.fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v)
    # direct per-pattern check: the reference cast of each input value
    assert_same(k8[..., :128], sat_fp8(k_nope), "k_nope patterns")
    assert_same(v8, sat_fp8(v), "v patterns")
    for h in range(H):
        assert_same(k8[:, h, 128:], sat_fp8(k_pe), f"k_pe patterns, head {h}")
    # NaN in -> NaN out, and the counts the notes report (65,282 bf16 / 63,490 fp16 non-NaN)
    assert int((~pats.isnan()).sum()) == (65282 if dtype == BF16 else 63490)
    assert bool(k8[:, 0, 128:].float().isnan()[k_pe.isnan()].all())
    assert bool(v8.float().isnan()[v.isnan()].all())
    # saturation: +-inf and every finite |x| > 448 give +-448
    big = ~pats.isnan() & (pats.float().abs() > 448)
    out = k8[..., :128].reshape(-1)[: pats.numel()].float()
    assert bool((out[big].abs() == 448).all())
    # and the whole thing equals the reference op
    rk, rv = fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v)
    assert_same(k8, rk, "k")
    assert_same(v8, rv, "v")
    # the bf16/fp16 concat copies every pattern, NaN payloads included
    assert_bits_equal(cuda_ext.fused_mla_kv_concat(k_nope, k_pe), fused_mla_kv_concat_reference(k_nope, k_pe))


# ---- cache: insert ----------------------------------------------------------------------------

CACHE_DTYPES = ["auto", "fp8", "fp8_ds_mla"]


def special_latents(T: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with hard cases mixed in, row by row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((T, width), generator=g) * torch.exp(torch.randn((T, 1), generator=g) * 3)
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).tiny
    for t in range(T):
        kind = t % 12
        if kind == 1:
            x[t, 3] = float("inf")
            x[t, width - 13] = float("-inf")
        elif kind == 2:
            x[t, 5] = float("nan")
        elif kind == 3:
            x[t] = x[t] * tiny  # subnormals and tiny normals
        elif kind == 4:
            x[t, :128 if width > 128 else width] = 0.0  # a zero tile
        elif kind == 5:
            x[t, :128 if width > 128 else width] = float("nan")  # a tile without a finite value
            if width > 256:
                x[t, 128:256] = float("inf")
        elif kind == 6:
            x[t] = x[t] * 1e30
            x[t, 7] = fmax
        elif kind == 7:  # values at and next to the fp8 range and ds_mla scale boundaries
            k = torch.arange(width) % 20 - 10
            x[t] = 448.0 * torch.pow(2.0, k.float()) * torch.where(torch.arange(width) % 3 == 0, -1.0, 1.0)
            x[t, 1::4] = torch.nextafter(x[t, 1::4], torch.full_like(x[t, 1::4], float("inf")))
            x[t, 2::4] = torch.nextafter(x[t, 2::4], torch.zeros_like(x[t, 2::4]))
        elif kind == 8:
            x[t] = torch.round(x[t] * 16) / 16 * 0.875  # many exact ties of the e4m3 grid
        elif kind == 9:
            x[t] = -0.0
        elif kind == 10:
            x[t] = x[t] * 1e-6  # amax far below 448 * 1e-4: the clamp of the scale
    return x.to(dtype)


def insert_case(cache_dtype: str, kv_dtype, pe_dtype, T=300, num_slots=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = special_latents(T, 512, kv_dtype, seed).to(DEV)
    pe = special_latents(T, 64, pe_dtype, seed + 1).to(DEV)
    slots = torch.randperm(num_slots, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 10]] = -1
    cache0 = torch.randint(0, 256, (num_slots, bytes_per_slot(cache_dtype)), dtype=torch.uint8, generator=g)
    return cache0.to(DEV), kv, pe, slots.to(DEV)


@pytest.mark.parametrize("k_scale", [1.0, 0.5, 4.0])
@pytest.mark.parametrize("kv_dtype,pe_dtype", [(F32, F32), (BF16, BF16), (F32, BF16), (BF16, F32)],
                         ids=["f32", "bf16", "f32+bf16pe", "bf16+f32pe"])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_insert(cuda_ext, cache_dtype, kv_dtype, pe_dtype, k_scale):
    cache0, kv, pe, slots = insert_case(cache_dtype, kv_dtype, pe_dtype)
    got, want = cache0.clone(), cache0.clone()
    cuda_ext.insert(got, kv, pe, slots, cache_dtype, k_scale)
    insert_reference(want, kv, pe, slots, cache_dtype, k_scale)
    slots_same(got, want, cache_dtype, f"insert {cache_dtype}")
    skipped = torch.ones(got.shape[0], dtype=torch.bool, device=DEV)
    skipped[slots[slots >= 0]] = False
    assert_bits_equal(got[skipped], cache0[skipped], "slots not written must be untouched")
    # through the public op, on a strided input (row stride > width)
    wide = torch.zeros((kv.shape[0], 640), dtype=kv.dtype, device=DEV)
    wide[:, 64:576] = kv
    got2 = cache0.clone()
    insert_op.insert(got2, wide[:, 64:576], pe, slots, cache_dtype, k_scale)
    assert_bits_equal(got2, got, "public op, strided kv_c")
    # rows that are not 16-byte aligned take the byte-wise kernel: same bytes
    wide[:, 65:577] = kv
    got3 = cache0.clone()
    cuda_ext.insert(got3, wide[:, 65:577], pe, slots, cache_dtype, k_scale)
    assert_bits_equal(got3, got, "unaligned kv_c")


@pytest.mark.parametrize("k_scale", [0.7, 3.0, 1.1])
def test_insert_fp8_k_scale_not_power_of_two(cuda_ext, k_scale):
    """x / k_scale with IEEE division (CONTRACT §2), as the reference computes it on the CPU."""
    cache0, kv, pe, slots = insert_case("fp8", F32, BF16, seed=3)
    got = cache0.clone()
    cuda_ext.insert(got, kv, pe, slots, "fp8", k_scale)
    want = cache0.cpu().clone()
    insert_reference(want, kv.cpu(), pe.cpu(), slots.cpu(), "fp8", k_scale)
    slots_same(got.cpu(), want, "fp8", f"insert fp8 k_scale={k_scale} vs CPU reference")
    on_gpu = cache0.clone()
    insert_reference(on_gpu, kv, pe, slots, "fp8", k_scale)
    n = int(((on_gpu != got) & ~(on_gpu.view(FP8).float().isnan() & got.view(FP8).float().isnan())).sum())
    if n:
        pytest.xfail(f"insert_reference on CUDA differs from IEEE x / {k_scale} in {n} bytes: torch computes "
                     "tensor / python scalar as tensor * (1/scalar) on CUDA (pytorch#191495); the kernel divides")


def test_insert_out_of_range_slots_are_skipped(cuda_ext):
    for cd in CACHE_DTYPES:
        cache0, kv, pe, slots = insert_case(cd, BF16, BF16, T=64, num_slots=128, seed=5)
        bad = slots.clone()
        bad[0], bad[1], bad[2] = 128, 10**12, -7
        got = cache0.clone()
        cuda_ext.insert(got, kv, pe, bad, cd, 1.0)
        torch.cuda.synchronize()
        want = cache0.clone()
        ok = bad.clone()
        ok[:3] = -1
        insert_reference(want, kv, pe, ok, cd, 1.0)
        slots_same(got, want, cd, f"{cd}: out-of-range slots")


def test_insert_errors(cuda_ext):
    cache0, kv, pe, slots = insert_case("fp8", F32, F32, T=8, num_slots=16)
    with pytest.raises(RuntimeError, match="cache_dtype"):
        cuda_ext.insert(cache0, kv, pe, slots, "fp16", 1.0)
    with pytest.raises(RuntimeError, match="bytes per slot"):
        cuda_ext.insert(cache0, kv, pe, slots, "auto", 1.0)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        cuda_ext.insert(cache0, kv, pe, slots.int(), "fp8", 1.0)
    with pytest.raises(RuntimeError, match="kv_c"):
        cuda_ext.insert(cache0, kv.half(), pe, slots, "fp8", 1.0)
    with pytest.raises(RuntimeError, match="k_scale"):
        cuda_ext.insert(cache0, kv, pe, slots, "fp8", 0.0)
    cuda_ext.insert(cache0, kv[:0], pe[:0], slots[:0], "fp8", 1.0)  # T = 0: nothing, no launch


# ---- cache: gather ----------------------------------------------------------------------------

GATHER_CASES = [("auto", BF16), ("fp8", BF16), ("fp8", FP8), ("fp8_ds_mla", BF16)]


def gather_case(cache_dtype, block_size, num_blocks=96, fill="insert", seed=0, lens=None, k_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    bps = bytes_per_slot(cache_dtype)
    if fill == "insert":
        cache = torch.zeros((num_slots, bps), dtype=torch.uint8, device=DEV)
        kv = (torch.randn((num_slots, 512), generator=g) * torch.exp(torch.randn((num_slots, 1), generator=g) * 2))
        pe = torch.randn((num_slots, 64), generator=g) * 3
        insert_reference(cache, kv.to(DEV), pe.to(DEV), torch.arange(num_slots, device=DEV), cache_dtype, k_scale)
    else:  # every byte pattern: NaN / inf / huge scales and values
        cache = torch.randint(0, 256, (num_slots, bps), dtype=torch.uint8, generator=g).to(DEV)
    lens = lens if lens is not None else [0, 37, 1, 0, 3 * block_size, block_size, 5, 0]
    n = len(lens)
    starts = [int(torch.randint(0, 3 * block_size, (1,), generator=g)) if i == 0 or i % 3 == 2 else 0
              for i in range(n)]  # continuations, not always on a block boundary
    need = [math.ceil((s + ln) / block_size) for s, ln in zip(starts, lens)]
    max_blocks = max(max(need), 1) + 2
    table = torch.randint(0, num_blocks, (n + 3, max_blocks), generator=g, dtype=torch.int32)
    bt = table.to(DEV)[2 : 2 + n]  # a row slice of a bigger table, as the engine passes it
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    st = torch.tensor(starts, dtype=torch.int32, device=DEV)
    return cache, bt, cu, st, int(cu[-1])


@pytest.mark.parametrize("fill", ["insert", "random_bytes"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("cache_dtype,out_dtype", GATHER_CASES, ids=[f"{c}->{'fp8' if o == FP8 else 'bf16'}"
                                                                     for c, o in GATHER_CASES])
def test_gather(cuda_ext, cache_dtype, out_dtype, block_size, fill):
    k_scale = 0.5 if out_dtype != FP8 else 1.0
    cache, bt, cu, st, rows = gather_case(cache_dtype, block_size, fill=fill, k_scale=k_scale)
    got = torch.full((rows, 576 * out_dtype.itemsize), 7, dtype=torch.uint8, device=DEV).view(out_dtype)
    want = got.clone()
    cuda_ext.gather(cache, bt, cu, st, got, cache_dtype, k_scale, block_size)
    gather_reference(cache, bt, cu, st, want, cache_dtype, k_scale, block_size)
    assert_same(got, want, f"gather {cache_dtype} -> {out_dtype}")
    # the public op on a workspace view, as the engine calls it
    ws = torch.empty(rows * 576 * out_dtype.itemsize + 64, dtype=torch.uint8, device=DEV)
    view = ws[: rows * 576 * out_dtype.itemsize].view(out_dtype).view(rows, 576)
    gather_op.gather(cache, bt, cu, st, view, cache_dtype, k_scale, block_size)
    assert_bits_equal(view, got, "public op")


@pytest.mark.parametrize("cache_dtype,out_dtype", GATHER_CASES, ids=[f"{c}->{'fp8' if o == FP8 else 'bf16'}"
                                                                     for c, o in GATHER_CASES])
def test_gather_unaligned_out(cuda_ext, cache_dtype, out_dtype):
    """An out that starts 2 bytes past 16-byte alignment: the byte-wise kernel, same bytes."""
    cache, bt, cu, st, rows = gather_case(cache_dtype, 16, fill="random_bytes", seed=6)
    isz = out_dtype.itemsize
    ws = torch.zeros(rows * 576 * isz + 64, dtype=torch.uint8, device=DEV)
    got = ws[2 : 2 + rows * 576 * isz].view(out_dtype).view(rows, 576)
    want = torch.empty((rows, 576), dtype=out_dtype, device=DEV)
    cuda_ext.gather(cache, bt, cu, st, got, cache_dtype, 0.5, 16)
    gather_reference(cache, bt, cu, st, want, cache_dtype, 0.5, 16)
    assert_same(got, want, "unaligned out")


@pytest.mark.parametrize("cache_dtype,out_dtype", GATHER_CASES, ids=[f"{c}->{'fp8' if o == FP8 else 'bf16'}"
                                                                     for c, o in GATHER_CASES])
def test_gather_long_context(cuda_ext, cache_dtype, out_dtype):
    """More rows than one wave of warps covers: the grid-stride loop; many sequences."""
    bs = 64
    lens = [70000 - 64 * 50] + [64] * 49 + [0, 3]
    cache, bt, cu, st, rows = gather_case(cache_dtype, bs, num_blocks=1200, fill="random_bytes", seed=2, lens=lens)
    got = torch.zeros((rows, 576), dtype=out_dtype, device=DEV)
    want = got.clone()
    cuda_ext.gather(cache, bt, cu, st, got, cache_dtype, 1.0, bs)
    gather_reference(cache, bt, cu, st, want, cache_dtype, 1.0, bs)
    assert_same(got, want, "long gather")


def test_gather_bad_block_ids_give_zeros(cuda_ext):
    bs = 16
    cache, bt, cu, st, rows = gather_case("auto", bs, num_blocks=32, lens=[40, 20], seed=4)
    st.zero_()
    bad = bt.clone()
    bad[0, 1] = -3  # rows 16..31 of sequence 0
    bad[1, 0] = 32  # == num_blocks: rows 40..55
    got = torch.full((rows, 576), 1.0, dtype=BF16, device=DEV)
    cuda_ext.gather(cache, bad, cu, st, got, "auto", 1.0, bs)
    want = torch.empty_like(got)
    gather_reference(cache, bt, cu, st, want, "auto", 1.0, bs)
    want[16:32] = 0
    want[40:56] = 0
    assert_bits_equal(got, want, "bad block ids")


def test_gather_errors_and_empty(cuda_ext):
    cache, bt, cu, st, rows = gather_case("auto", 16, lens=[5, 3])
    out = torch.empty((rows, 576), dtype=FP8, device=DEV)
    with pytest.raises(RuntimeError, match="fp8"):
        cuda_ext.gather(cache, bt, cu, st, out, "auto", 1.0, 16)
    with pytest.raises(RuntimeError, match="cu_seq_lens"):
        cuda_ext.gather(cache, bt, cu[:-1], st, torch.empty((rows, 576), dtype=BF16, device=DEV), "auto", 1.0, 16)
    with pytest.raises(RuntimeError, match="block_table"):
        cuda_ext.gather(cache, bt.long(), cu, st, torch.empty((rows, 576), dtype=BF16, device=DEV), "auto", 1.0, 16)
    cuda_ext.gather(cache, bt, cu, st, torch.empty((0, 576), dtype=BF16, device=DEV), "auto", 1.0, 16)


# ---- merge ------------------------------------------------------------------------------------


def merge_case(T, H, V=128, lse_layout="ht", seed=0, pad=5):
    """out / lse as strided views into bigger buffers (rows q0 .. q0+T), specials mixed in."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    Tf = T + 2 * pad
    out_full = torch.randn((Tf, H, V), device=DEV, generator=g).to(BF16)
    if lse_layout == "ht":
        lse_full = torch.randn((H, Tf), device=DEV, generator=g) * 4
    else:  # transposed storage: lse[h, t] at t * H + h
        lse_full = (torch.randn((Tf, H), device=DEV, generator=g) * 4).t()
    part = torch.randn((T, H, V), device=DEV, generator=g).to(BF16)
    plse = torch.randn((H, T), device=DEV, generator=g) * 4
    # specials, by row position mod 8
    a = lse_full[:, pad : pad + T]
    tm = torch.arange(T, device=DEV) % 8
    ninf, inf = float("-inf"), float("inf")
    a[:, tm == 1] = ninf
    plse[:, tm == 2] = ninf
    a[:, tm == 3] = ninf
    plse[:, tm == 3] = ninf  # both empty -> 0 / -inf
    a[:, tm == 4] = inf  # +inf is read as -inf
    plse[:, tm == 5] = inf
    a[:, tm == 5] = ninf  # +inf and -inf: empty
    a[:, tm == 6] = 80.0
    plse[:, tm == 6] = -80.0  # one weight underflows to 0
    plse[:, tm == 7] = a[:, tm == 7]  # equal: weights 0.5 / 0.5
    return out_full, lse_full, part, plse, pad


def _view(out_full, lse_full, pad, T):
    return out_full[pad : pad + T], lse_full[:, pad : pad + T]


@pytest.mark.parametrize("lse_layout", ["ht", "transposed"])
@pytest.mark.parametrize("T,H", [(1, 1), (37, 3), (1000, 16), (4097, 128), (70001, 16)])
def test_merge(cuda_ext, T, H, lse_layout):
    out_full, lse_full, part, plse, pad = merge_case(T, H, lse_layout=lse_layout)
    o1, l1 = out_full.clone(), lse_full.clone()
    o2, l2 = out_full.clone(), lse_full.clone()
    if lse_layout == "transposed":  # keep the transposed storage in the copies
        l1 = lse_full.t().clone().t()
        l2 = lse_full.t().clone().t()
    ov, lv = _view(o1, l1, pad, T)
    assert lv.stride() == ((1, H) if lse_layout == "transposed" else (T + 2 * pad, 1))
    cuda_ext.merge(ov, lv, part, plse)
    merge_reference(*_view(o2, l2, pad, T), part, plse)
    _assert_merge_equal(o1, o2, l1, l2)
    assert_bits_equal(o1[:pad], out_full[:pad], "rows before the view untouched")
    assert_bits_equal(o1[pad + T :], out_full[pad + T :], "rows after the view untouched")
    # the rules themselves
    ov, lv = _view(o1, l1, pad, T)
    empty = (torch.arange(T, device=DEV) % 8 == 3) | (torch.arange(T, device=DEV) % 8 == 5)
    assert bool((lv[:, empty] == float("-inf")).all()) and bool((ov[empty] == 0).all())
    assert not bool(lv.isnan().any()) and not bool(ov.isnan().any())
    # the public op
    o3, l3 = out_full.clone(), (lse_full.t().clone().t() if lse_layout == "transposed" else lse_full.clone())
    merge_op.merge(*_view(o3, l3, pad, T), part, plse)
    assert_bits_equal(o3, o1, "public op out")
    assert_bits_equal(l3, l1, "public op lse")


def _assert_merge_equal(o_got, o_want, l_got, l_want):
    d = int((bits(o_got) != bits(o_want)).sum())
    dl = int((bits(l_got) != bits(l_want)).sum())
    if d or dl:
        ulp_o = (bits(o_got).int() - bits(o_want).int()).abs().max().item()
        fin = torch.isfinite(l_want) & torch.isfinite(l_got)
        ulp_l = (bits(l_got)[fin].long() - bits(l_want)[fin].long()).abs().max().item() if bool(fin.any()) else 0
        raise AssertionError(f"merge differs from merge_reference on CUDA: {d} out elements (max {ulp_o} bf16 ulp), "
                             f"{dl} lse elements (max {ulp_l} f32 ulp) — expf/logf or rounding order differ")


@pytest.mark.parametrize("V", [64, 128])
def test_merge_generic_path(cuda_ext, V):
    """V != 128 and unaligned rows take the element-wise kernel: same bytes."""
    T, H = 50, 3
    out_full, lse_full, part, plse, pad = merge_case(T, H, V=V, seed=1)
    wide = torch.zeros((out_full.shape[0], H, V + 1), dtype=BF16, device=DEV)
    wide[..., 1:] = out_full  # rows start 2 bytes past 16-byte alignment
    o1, o2 = wide.clone(), wide.clone()
    l1, l2 = lse_full.clone(), lse_full.clone()
    cuda_ext.merge(o1[pad : pad + T, :, 1:], l1[:, pad : pad + T], part, plse)
    merge_reference(o2[pad : pad + T, :, 1:], l2[:, pad : pad + T], part, plse)
    _assert_merge_equal(o1, o2, l1, l2)


def test_merge_errors_and_empty(cuda_ext):
    out_full, lse_full, part, plse, pad = merge_case(4, 2)
    o, lse = _view(out_full, lse_full, pad, 4)
    with pytest.raises(RuntimeError, match="lse"):
        cuda_ext.merge(o, lse.t(), part, plse)
    with pytest.raises(RuntimeError, match="part_out"):
        cuda_ext.merge(o, lse, part[:3], plse)
    with pytest.raises(RuntimeError, match="bfloat16|BFloat16"):
        cuda_ext.merge(o.float(), lse, part, plse)
    cuda_ext.merge(o[:0], lse[:, :0], part[:0], plse[:, :0])
