"""Insert writes exactly the bytes CONTRACT §2 prescribes; gather/dequantize reads them back.

The expected bytes here are computed independently of ops/slot_format.py: the
CONTRACT §2's torch formulas for bf16 and fp8, and a per-tile float64/struct computation
for fp8_ds_mla.
"""

import math
import struct

import pytest
import torch

from ctxprefill.cache import PagedLatentCache, host_slots
from ctxprefill.config import CacheConfig
from ctxprefill.errors import InvalidArgument, OutOfRange
from ctxprefill.ops.gather import gather
from ctxprefill.ops.slot_format import decode_slots

FP8 = torch.float8_e4m3fn
INF, NAN = float("inf"), float("nan")


def hostile_latents(T=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn((T, 512), generator=g) * 3
    pe = torch.randn((T, 64), generator=g)
    c[0, :4] = torch.tensor([1e6, -1e6, 500.0, -465.0])  # overflow: saturate
    c[1, :3] = torch.tensor([INF, -INF, NAN])
    c[2, :128] = 0.0  # an all-zero tile: the 1e-4 floor
    c[3, 128:256] = torch.tensor(2.0**-20)  # tiny values: subnormal fp8 after scaling
    c[4, 256:384] *= 1e4  # a large tile
    c[5, 384:] = 448.0 * 4  # amax exactly a power of two times 448
    pe[1, :3] = torch.tensor([INF, -INF, 1e30])
    return c.to(dtype), pe.to(dtype)


def sat_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8).view(torch.uint8)


def expected_ds_mla(c: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    rows = []
    for t in range(c.shape[0]):
        out = bytearray()
        scales = []
        for tile in range(4):
            x = c[t, tile * 128 : (tile + 1) * 128].double()
            finite = x[torch.isfinite(x)]
            amax = finite.abs().max().item() if finite.numel() else 0.0
            ratio = max(float(torch.tensor(amax, dtype=torch.float32) / 448.0), 1e-4)
            # exact ceil(log2) on the float32 ratio: smallest power of two >= ratio
            e = math.frexp(ratio)[1]
            scale = 2.0 ** (e - 1) if math.frexp(ratio)[0] == 0.5 else 2.0**e
            assert scale >= ratio and scale / 2 < ratio
            scales.append(scale)
            out += bytes(sat_fp8_bytes((x / scale).float()).tolist())
        out += struct.pack("<4f", *scales)
        out += bytes(pe[t].to(torch.bfloat16).view(torch.uint8).tolist())
        rows.append(torch.tensor(list(out), dtype=torch.uint8))
    return torch.stack(rows)


def expected_bytes(dtype, c, pe, k_scale):
    if dtype == "auto":
        return torch.cat([c.to(torch.bfloat16), pe.to(torch.bfloat16)], 1).view(torch.uint8)
    if dtype == "fp8":
        return sat_fp8_bytes(torch.cat([c.float(), pe.float()], 1) / k_scale)
    return expected_ds_mla(c, pe)


def same_bytes_nan_aware(got: torch.Tensor, want: torch.Tensor, dtype: str):
    """Bytes equal, except that a NaN may be any NaN (sign and payload are not contract)."""
    if dtype == "fp8_ds_mla":
        assert torch.equal(got[:, 512:], want[:, 512:])
        got_v, want_v = got[:, :512].view(FP8).float(), want[:, :512].view(FP8).float()
    elif dtype == "fp8":
        got_v, want_v = got.view(FP8).float(), want.view(FP8).float()
    else:
        got_v, want_v = got.view(torch.bfloat16).float(), want.view(torch.bfloat16).float()
    nan = torch.isnan(want_v)
    assert torch.equal(torch.isnan(got_v), nan)
    assert torch.equal(got_v[~nan].view(torch.int32), want_v[~nan].view(torch.int32))


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype,k_scale", [("auto", 1.0), ("fp8", 1.0), ("fp8", 0.37), ("fp8_ds_mla", 1.0)])
def test_insert_bytes_match_spec(dtype, k_scale, in_dtype):
    cache = PagedLatentCache(CacheConfig(dtype, block_size=4, num_blocks=4, k_scale=k_scale), "cpu")
    c, pe = hostile_latents(dtype=in_dtype)
    slots = torch.tensor([5, 0, 15, -1, 7, 3], dtype=torch.int64)
    assert cache.write(slots, c, pe) == 5
    keep = slots >= 0
    got = cache.read(slots[keep])
    want = expected_bytes(dtype, c[keep], pe[keep], k_scale)
    assert got.shape == (5, cache.config.bytes_per_slot)
    same_bytes_nan_aware(got, want, dtype)
    # the skipped token wrote nothing: slot 1 (never written) is still all zero
    assert int(cache.read(torch.tensor([1])).sum()) == 0


def test_bad_slot_rejected_before_any_write():
    cache = PagedLatentCache(CacheConfig("auto", block_size=4, num_blocks=2), "cpu")
    c, pe = hostile_latents()
    before = cache.storage.clone()
    with pytest.raises(OutOfRange, match=r"slot_mapping\[2\]"):
        cache.write(torch.tensor([0, 1, 8, 2, 3, 4]), c, pe)
    with pytest.raises(OutOfRange, match=r"slot_mapping\[0\]"):
        cache.write(torch.tensor([-2, 1, 2, 3, 4, 5]), c, pe)
    with pytest.raises(InvalidArgument, match="kv_c"):
        cache.write(torch.tensor([0, 1]), c, pe[:2])
    with pytest.raises(InvalidArgument, match="slot_mapping"):
        cache.write(torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32), c, pe)
    with pytest.raises(OutOfRange):
        cache.read(torch.tensor([-1]))
    assert torch.equal(cache.storage, before)


def test_ds_mla_dequantization_is_exact():
    """fp8 value × power-of-two tile scale is exact in float32 and in bf16."""
    cache = PagedLatentCache(CacheConfig("fp8_ds_mla", block_size=4, num_blocks=2), "cpu")
    c, pe = hostile_latents()
    slots = torch.arange(6, dtype=torch.int64)
    cache.write(slots, c, pe)
    raw = cache.read(slots)
    deq32 = decode_slots(raw, "fp8_ds_mla", 1.0, torch.float32)
    deq16 = decode_slots(raw, "fp8_ds_mla", 1.0, torch.bfloat16)
    q = raw[:, :512].contiguous().view(FP8).double().reshape(6, 4, 128)
    s = raw[:, 512:528].contiguous().view(torch.float32).double().reshape(6, 4, 1)
    exact = (q * s).reshape(6, 512)
    fin = torch.isfinite(exact)
    assert torch.equal(deq32[:, :512].double()[fin], exact[fin])
    assert torch.equal(deq16[:, :512].double()[fin], exact[fin])
    assert torch.equal(deq16[:, 512:], pe.to(torch.bfloat16))
    # quantization error: half an e4m3 ulp (2^-4 relative), or half the subnormal step
    # (2^-10) of the tile scale, for every value that did not saturate
    scale = s.reshape(6, 4).repeat_interleave(128, 1)
    ok = torch.isfinite(c) & (c.abs() <= 448 * scale)
    err = (exact - c.double()).abs()
    assert bool((err[ok] <= 2**-4 * c.double().abs()[ok] + scale[ok] * 2**-10).all())


@pytest.mark.parametrize("dtype,out_dtype", [("auto", torch.bfloat16), ("fp8", torch.bfloat16), ("fp8", FP8),
                                             ("fp8_ds_mla", torch.bfloat16)])
def test_gather_reads_the_right_slots(dtype, out_dtype):
    bs = 4
    k_scale = 0.5 if out_dtype != FP8 else 1.0
    cache = PagedLatentCache(CacheConfig(dtype, block_size=bs, num_blocks=8, k_scale=k_scale), "cpu")
    T = 32
    c, pe = torch.randn(T, 512), torch.randn(T, 64)
    cache.write(torch.arange(T), c, pe)
    # two sequences: blocks [5, 2, 7] from token 3 (a continuation) for 6 rows; blocks [0] for 2 rows
    bt = torch.tensor([[5, 2, 7], [0, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 6, 8], dtype=torch.int32)
    starts = torch.tensor([3, 0], dtype=torch.int32)
    out = torch.empty((8, 576), dtype=out_dtype)
    gather(cache.storage, bt, cu, starts, out, dtype, cache.config.k_scale, bs)
    want_slots = [5 * bs + 3, 2 * bs + 0, 2 * bs + 1, 2 * bs + 2, 2 * bs + 3, 7 * bs + 0, 0, 1]
    want = decode_slots(cache.storage[want_slots], dtype, cache.config.k_scale, out_dtype)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_slots_used_counts_distinct_slots_ever_written():
    cache = PagedLatentCache(CacheConfig("auto", block_size=4, num_blocks=4), "cpu")
    c, pe = hostile_latents()
    cache.write(torch.tensor([5, 0, 5, -1, 7, 3]), c, pe)  # 5 twice, -1 skipped
    assert cache.slots_used == 4
    cache.write(torch.tensor([0, 1, 1, -1, -1, 2]), c, pe)
    assert cache.slots_used == 6


@pytest.mark.parametrize("allow_skip", [True, False])
@pytest.mark.parametrize("bad", [16, -2, -(2**63), 2**63 - 1])
def test_host_slots_names_the_first_slot_out_of_range(allow_skip, bad):
    """Checked in one unsigned pass: the int64 extremes must not wrap into the valid range."""
    ok = [0, 15, -1] if allow_skip else [0, 15, 3]
    with pytest.raises(OutOfRange, match=r"slot_mapping\[3\]"):
        host_slots(torch.tensor([*ok, bad, 99]), 16, "slot_mapping", allow_skip)
    assert host_slots(torch.tensor(ok), 16, "slot_mapping", allow_skip).tolist() == ok
    if not allow_skip:
        with pytest.raises(OutOfRange, match=r"slot_mapping\[0\]"):
            host_slots(torch.tensor([-1]), 16, "slot_mapping", False)
