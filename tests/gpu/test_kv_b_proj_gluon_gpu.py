"""The persistent warp-specialized kv_b_proj GEMM (ops/kv_b_proj_gluon.py) on the GPU:
within one bf16 rounding (plus fp32 accumulation's error) of a float64 product on shapes
with partial tiles in M, N and K, every configuration probe_gemm tries, the same bits on
every call, ``out`` honoured, and its refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import HAS_CUDA, NO_CUDA_REASON
from ctxprefill.ops import kv_b_proj as kvb
from ctxprefill.ops import kv_b_proj_gluon as kg

needs_hopper = pytest.mark.skipif(
    not HAS_CUDA or bool(kg.GLUON_ERR) or torch.cuda.get_device_capability()[0] != 9,
    reason=NO_CUDA_REASON if not HAS_CUDA else (kg.GLUON_ERR or "a Hopper kernel"))

def _operands(M: int, N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn((M, K), generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn((N, K), generator=g, device="cuda") * K**-0.5).to(torch.bfloat16)
    return a, w


def _assert_close_to_float64(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    ref = a.double() @ w.double().t()
    # one rounding to bf16 (2^-8 relative) and fp32 accumulation over K terms (2 ulp each, generous)
    bound = ref.abs() * 2.0**-8 + (a.double().abs() @ w.double().abs().t()) * a.shape[1] * 2.0**-22 + 1e-30
    err = (got.double() - ref).abs()
    excess = (err - bound).max().item()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, worst excess {excess:.3g}"


@needs_hopper
@pytest.mark.parametrize("cfg", kg.TUNING, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("M,N,K", [(16384, 4096, 512), (1000, 16 * 256, 512), (130, 384, 512), (64, 256, 96),
                                   (1, 256, 512), (300, 32 * 256, 512)])
def test_gemm_against_float64(cfg, M, N, K):
    a, w = _operands(M, N, K)
    got = kg.kv_b_proj_gluon(a, w, config=cfg)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    _assert_close_to_float64(got, a, w)
    again = kg.kv_b_proj_gluon(a, w, config=cfg)
    assert torch.equal(got.view(torch.int16), again.view(torch.int16))  # deterministic


@needs_hopper
def test_out_strided_rows_and_empty():
    a, w = _operands(200, 512, 512, seed=1)
    big = torch.full((200, 640), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = big[:, 64:576]  # rows 1,280 B apart: a view with a 16-byte multiple stride
    assert kg.kv_b_proj_gluon(a, w, out=out) is out
    _assert_close_to_float64(out, a, w)
    assert bool(big[:, :64].isnan().all() and big[:, 576:].isnan().all())  # nothing written outside
    wide = torch.randn((200, 1024), device="cuda").to(torch.bfloat16)
    _assert_close_to_float64(kg.kv_b_proj_gluon(wide[:, :512], w), wide[:, :512], w)  # strided latent rows
    assert kg.kv_b_proj_gluon(a[:0], w).shape == (0, 512)
    z = kg.kv_b_proj_gluon(a[:, :0].contiguous(), w[:, :0].contiguous())
    assert bool((z == 0).all())


def test_refusals():
    """Refused before any launch (on any machine): the dtype, mismatched shapes, a wrong ``out``."""
    a = torch.zeros((4, 512), dtype=torch.bfloat16, device="cuda" if HAS_CUDA else "cpu")
    w = torch.zeros((256, 512), dtype=torch.float32, device=a.device)
    with pytest.raises(ValueError, match="bf16"):
        kg.kv_b_proj_gluon(a, w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        kg.kv_b_proj_gluon(a, a[:, :256].t())
    if HAS_CUDA and not kg.GLUON_ERR and torch.cuda.get_device_capability()[0] == 9:
        with pytest.raises(ValueError, match="out must be"):
            kg.kv_b_proj_gluon(a, w.to(torch.bfloat16), out=torch.empty((4, 128), dtype=torch.bfloat16,
                                                                          device="cuda"))


@needs_hopper
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("lens,starts", [([1640], [0]), ([640, 1024, 37], [64, 0, 1280]), ([5], [128]),
                                         ([16384], [16384]), ([0, 64, 0, 100], [0, 128, 64, 64])])
def test_paged_gemm_equals_gather_then_gemm(heads, block_size, lens, starts):
    """launch_paged reads each row's latent from its cache slot (shuffled blocks, several
    sequences starting on 64-row pages, the last ending anywhere) and gives the bits of the
    gather followed by the GEMM on the gathered latent; it leaves each row's k_pe in the
    workspace as the gather does, and writes no other column of it."""
    from ctxprefill.ops.gather import gather_reference

    g = torch.Generator(device="cuda").manual_seed(block_size + len(lens))
    need = [-(-(s + n) // block_size) for s, n in zip(starts, lens)]
    num_blocks = sum(need) + 7
    slots = num_blocks * block_size
    cache = (torch.randn((slots, 576), generator=g, device="cuda") * 3).to(torch.bfloat16).view(torch.uint8)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    table = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(need):
        table[b, :nb] = torch.tensor(perm[at : at + nb])
        at += nb
    table = table.cuda()
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    st = torch.tensor(starts, dtype=torch.int32, device="cuda")
    M = int(cu[-1])
    assert kvb.chunk_pages_aligned(cu.tolist(), starts)
    _, w = _operands(8, heads * 256, 512, seed=3)
    gathered = torch.empty((M, 576), dtype=torch.bfloat16, device="cuda")
    gather_reference(cache, table, cu, st, gathered, "auto", 1.0, block_size)
    want = kg.launch(gathered[:, :512], w)
    assert kg.paged_problem(cache, w, block_size) is None
    ws = torch.full((M + 3, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = kg.launch_paged(cache, table, cu, st, block_size, ws[:M], w)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(ws[:M, 512:].view(torch.int16), gathered[:, 512:].view(torch.int16))
    assert bool(ws[:, :512].isnan().all() and ws[M:].isnan().all())  # the latent is read where it lies


def test_paged_refusals():
    """paged_problem names what it cannot read: a cache that is not bf16's bytes, a block
    size off the 64-row pages."""
    dev = "cuda" if HAS_CUDA else "cpu"
    w = torch.zeros((256, 512), dtype=torch.bfloat16, device=dev)
    if kg.GLUON_ERR:
        assert kg.paged_problem(torch.zeros((4, 1152), dtype=torch.uint8), w, 64) == kg.GLUON_ERR
        return
    assert "bf16 cache's bytes" in kg.paged_problem(torch.zeros((4, 656), dtype=torch.uint8, device=dev), w, 64)
    assert "multiple of 64" in kg.paged_problem(torch.zeros((4, 1152), dtype=torch.uint8, device=dev), w, 16)
