"""The cudnn-frontend attention backend, CPU side, and ``auto``'s start-up probe.

No cuDNN here, so the backend runs with cuDNN replaced by ``EmulatedCudnn``: a float64
emulation of the ragged SDPA graph the backend declares, which reads q/k/v and writes
o/stats *only* through the declared dims/strides, the ragged offsets and the lengths that
the backend's metadata kernel produced (the documented meaning of a ragged cuDNN graph:
element offsets, [B, H, S, D] dims, per-sequence lengths under a padding mask), and leaves
NaN where cuDNN's result for a row that sees no key is unspecified. Everything of ours
then runs for real — buckets, the graph cache, the metadata and fix-up Triton kernels (in
Triton's interpreter on a CPU), the ``out`` contract, copies, noted launches — against the
float64 reference of tests/test_backend_cudnn.py. That cuDNN interprets the declaration
the same way is for tests/gpu/test_backend_cudnn_frontend_gpu.py.

Where the cuDNN frontend package is importable (not in CI: it is a GPU-machine wheel,
``.whl/``), the declared pygraph is also checked tensor by tensor; it validates without a
GPU. The probe tests use stand-in backend classes and timings.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
triton = pytest.importorskip("triton", reason="triton is not importable; the cudnn-frontend backend's kernels need it")

from ctxprefill.backends import cudnn_frontend as cf  # noqa: E402
from ctxprefill.backends import registry  # noqa: E402
from ctxprefill.backends.base import AttentionBackend, BackendCaps  # noqa: E402
from ctxprefill.backends.cudnn_frontend import CudnnFrontendBackend, GraphKey, bucket, graph_spec  # noqa: E402
from ctxprefill.backends.reference import ReferenceBackend  # noqa: E402
from ctxprefill.ops import launches  # noqa: E402
from test_backend_cudnn import check, make_batch, reference  # noqa: E402  (shared float64 helpers)

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
needs_kernels = pytest.mark.skipif(DEV == "cpu" and not cf._interpreting(),
                                   reason="no GPU and TRITON_INTERPRET was not set before triton was imported")
SCALE = 192**-0.5

Q_LENS = [5, 0, 1, 37, 3, 20, 1]  # B = 7: bucket 8, one padding sequence
K_LENS = [9, 4, 0, 1, 50, 33, 1]  # an empty key segment, one-token ones, q_len > k_len


# ----------------------------------------------------------------------------- the stand-in for cuDNN
class EmulatedCudnn(CudnnFrontendBackend):
    """The backend with cuDNN's graph build and execution emulated (see the module docstring)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.executes = 0
        self.seen = []  # (key, q lengths, k lengths) per execution

    def _build(self, key, device):
        return cf._Graph(key, graph_spec(key), tuple(cf._UID[n] for n in cf._buffer_names(key)), 0, 0.0)

    def _execute(self, entry, bufs, device):
        key, spec = entry.key, entry.graph
        assert set(bufs) == set(cf._buffer_names(key))
        lq = bufs["seq_len_q"].reshape(-1).tolist()
        lk = bufs["seq_len_kv"].reshape(-1).tolist()
        assert len(lq) == len(lk) == key.B
        offs = {n: bufs[n].reshape(-1).tolist() for n in cf._OFFSET_COLUMNS if n in bufs}
        for n, o in offs.items():
            assert bufs[n].dtype == torch.int64 and len(o) == key.B + 1 and o == sorted(o), (n, o)
        for name, t in bufs.items():  # what is declared is what is bound
            want = {"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.bfloat16, "o": torch.bfloat16,
                    "stats": torch.float32, "seq_len_q": torch.int32, "seq_len_kv": torch.int32}.get(name, torch.int64)
            assert t.dtype == want, name
        self.executes += 1
        self.seen.append((key, lq, lk))
        H = key.H

        def view(name, b, L):
            s = spec[name]
            base = offs[s.ragged][b] if s.ragged else b * s.stride[0]
            t = bufs[name]
            size, stride = (H, L, s.dim[3]), s.stride[1:]
            if L:  # stays inside the buffer's storage
                last = t.storage_offset() + base + sum((n - 1) * st for n, st in zip(size, stride))
                assert base >= 0 and last < t.untyped_storage().nbytes() // t.element_size(), (name, b, base, last)
            return torch.as_strided(t, size, stride, t.storage_offset() + base)

        for b in range(key.B):
            Lq, Lk = lq[b], lk[b]
            assert 0 <= Lq <= key.S_q and 0 <= Lk <= key.S_kv, (b, Lq, Lk, key)
            if Lq == 0:
                continue
            qb = view("q", b, Lq).double()
            kb, vb = view("k", b, Lk).double(), view("v", b, Lk).double()
            s = torch.einsum("hqd,hkd->hqk", qb, kb) * key.scale
            if key.causal:
                vis = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
                s = s.masked_fill(~vis.to(s.device), float("-inf"))
            lse = torch.logsumexp(s, -1) if Lk else torch.full((H, Lq), float("-inf"), dtype=torch.float64,
                                                                 device=s.device)
            o = torch.einsum("hqk,hkd->hqd", torch.exp(s - lse[..., None]), vb)
            dead = torch.isinf(lse)  # unspecified in cuDNN: the worst case
            o[dead] = float("nan")
            lse = lse.masked_fill(dead, float("nan"))
            view("o", b, Lq).copy_(o.to(torch.bfloat16))
            view("stats", b, Lq)[..., 0].copy_(lse.float())


def call(be, q, k, v, cu_q, cu_k, max_q, max_k, out=None, causal=False, scale=SCALE):
    """(out, lse, launches noted), as the engine calls a backend."""
    counts = Counter()
    with launches.stage(counts, "attention"):
        launches.note(be.caps.launches_per_call)
        o, lse = be.run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale, out=out, causal=causal)
    return o, lse, counts["attention"]


# ----------------------------------------------------------------------------- pure parts
def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert bucket(1, 64) == 64 and bucket(65, 64) == 128


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_graph_spec(layout):
    key = GraphKey(device="cuda:0", H=16, B=4, S_q=1024, S_kv=2048, q_stride=(3072, 192), k_stride=(3072, 192),
                   v_stride=(4096, 256), o_stride=(2048, 128), scale=0.1, causal=False, stats_layout=layout)
    spec = graph_spec(key)
    assert spec["q"].dim == (4, 16, 1024, 192) and spec["q"].stride == (1024 * 3072, 192, 3072, 1)
    assert spec["k"].dim == (4, 16, 2048, 192) and spec["k"].stride == (2048 * 3072, 192, 3072, 1)
    assert spec["v"].dim == (4, 16, 2048, 128) and spec["v"].stride == (2048 * 4096, 256, 4096, 1)
    assert spec["o"].dim == (4, 16, 1024, 128) and spec["o"].stride == (1024 * 2048, 128, 2048, 1)
    assert [spec[n].ragged for n in "qkvo"] == ["ragged_q", "ragged_k", "ragged_v", "ragged_o"]
    assert spec["seq_len_q"].dim == spec["seq_len_kv"].dim == (4, 1, 1, 1)
    assert spec["ragged_q"].dim == (5, 1, 1, 1)
    if layout == "packed":  # token-major [Tq, H]
        assert spec["stats"].stride == (1024 * 16, 1, 16, 1) and spec["stats"].ragged == "ragged_stats"
    else:
        assert spec["stats"].stride == (16 * 1024, 1024, 1, 1) and spec["stats"].ragged is None
        assert "ragged_stats" not in spec
    assert set(cf._buffer_names(key)) == set(spec)
    with pytest.raises(ValueError, match="stats_layout"):
        graph_spec(GraphKey(**{**key.__dict__, "stats_layout": "other"}))


def test_interface_and_availability():
    be = CudnnFrontendBackend()
    assert be.name == "cudnn-frontend" and be.caps.supports_out and not be.caps.unpacked_keys
    assert be.caps.launches_per_call == 0, "path-dependent: the backend notes its own launches"
    assert cf.CUDNN_KERNELS >= 1 and be.stats_layout == cf.STATS_LAYOUT
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    why = CudnnFrontendBackend.unavailable_reason(cpu, torch.bfloat16)
    assert why and "CUDA" in why, why
    assert CudnnFrontendBackend.caps.q_dtypes == {torch.bfloat16}
    for dev in (cpu, cuda):
        assert "dtype not supported" in CudnnFrontendBackend.unavailable_reason(dev, FP8)
        assert "dtype not supported" in CudnnFrontendBackend.unavailable_reason(dev, torch.float16)
    with pytest.raises(ValueError, match="stats_layout"):
        CudnnFrontendBackend(stats_layout="dense")
    q, k, v, cu_q, cu_k = make_batch([2], [3], 1)
    with pytest.raises(ValueError, match="packed keys"):  # not in its caps: refused, not ignored
        be.run_context_chunk(q, k[..., :128], v, cu_q, cu_k, 2, 3, 0.1, k_rope=k[..., 128:])


def test_registry():
    assert "cudnn-frontend" in registry.names()
    assert registry.backend_class("cudnn-frontend") is CudnnFrontendBackend
    assert "cudnn-frontend" not in registry._AUTO_ORDER  # a graph build per shape bucket: probed, not static
    assert registry._AUTO_ORDER == ("gluon", "triton", "reference")
    assert registry._PROBE_FIRST == ("gluon", "triton") and registry._PROBE_OTHERS == ("cudnn-frontend",)
    with pytest.raises(ValueError, match="not available"):
        registry.create("cudnn-frontend", torch.device("cpu"), torch.bfloat16)


def test_addressable():
    x = torch.zeros(10, 3, 256, dtype=torch.bfloat16)
    assert cf._addressable(x[..., :192]) and cf._addressable(x[..., 128:])
    assert not cf._addressable(x[..., 1:193])  # base not 16-byte aligned
    assert not cf._addressable(x.transpose(0, 1).contiguous().transpose(0, 1)[..., :192])  # head-major
    assert not cf._addressable(torch.zeros(10, 3, 193, dtype=torch.bfloat16)[..., :192])  # odd row stride
    assert not cf._addressable(torch.zeros(10, 192, 3, dtype=torch.bfloat16).transpose(1, 2))  # last stride


def test_bad_arguments():
    be = EmulatedCudnn()
    q, k, v, cu_q, cu_k = make_batch([2], [3], 2, device=DEV)
    with pytest.raises(ValueError, match="bfloat16"):
        be.run_context_chunk(q.half(), k.half(), v.half(), cu_q, cu_k, 2, 3, SCALE)
    with pytest.raises(ValueError, match="int32"):
        be.run_context_chunk(q, k, v, cu_q.long(), cu_k, 2, 3, SCALE)
    with pytest.raises(ValueError, match="out must be"):
        be.run_context_chunk(q, k, v, cu_q, cu_k, 2, 3, SCALE, out=torch.empty(2, 2, 128, device=DEV))
    with pytest.raises(ValueError, match="expected q"):
        be.run_context_chunk(q, k, v[..., :64], cu_q, cu_k, 2, 3, SCALE)


# ----------------------------------------------------------------------------- the call, emulated cuDNN
@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("H", [1, 3])
def test_ragged_against_float64(H, layout, causal):
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, device=DEV, seed=H)
    be = EmulatedCudnn(stats_layout=layout)
    out, lse, noted = call(be, q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], H, 128)
    assert lse.dtype == torch.float32 and lse.shape == (H, q.shape[0]) and lse.is_contiguous()
    check(out, lse, *reference(q, k, v, cu_q, cu_k, SCALE, causal))
    assert noted == 2 + cf.CUDNN_KERNELS and be.last_copy == ""
    (key, lq, lk), = be.seen
    assert key.B == 8 and key.S_q == 64 and key.S_kv == 64 and key.causal == causal
    assert lq == Q_LENS + [0] and lk == K_LENS + [0]  # the padding sequence is empty


@needs_kernels
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_empty_rows_are_exact(causal):
    # segment 1 has no keys; causal: 30 queries over 3 keys -> the first 27 rows see nothing.
    # The emulation writes NaN into those rows, as an unspecified cuDNN result might.
    q, k, v, cu_q, cu_k = make_batch([4, 6, 30], [7, 0, 3], 2, device=DEV, seed=7)
    out, lse, _ = call(EmulatedCudnn(), q, k, v, cu_q, cu_k, 30, 7, causal=causal)
    assert (out[4:10] == 0).all() and (lse[:, 4:10] == float("-inf")).all()
    if causal:
        assert (out[10:37] == 0).all() and (lse[:, 10:37] == float("-inf")).all()
        assert torch.isfinite(lse[:, 37:]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check(out, lse, *reference(q, k, v, cu_q, cu_k, SCALE, causal))


@needs_kernels
def test_no_keys_at_all_skips_cudnn():
    q, k, v, cu_q, cu_k = make_batch([3, 2], [0, 0], 3, device=DEV)
    be = EmulatedCudnn()
    out = torch.full((5, 3, 128), 7.0, dtype=torch.bfloat16, device=DEV)
    got, lse, noted = call(be, q, k, v, cu_q, cu_k, 3, 0, out=out)
    assert got is out and (out == 0).all() and (lse == float("-inf")).all()
    assert be.executes == 0 and be.builds == 0 and noted == 1  # the fix-up kernel only


@needs_kernels
def test_nothing_to_compute():
    be = EmulatedCudnn()
    q, k, v, cu_q, cu_k = make_batch([0, 0], [3, 2], 2, device=DEV)
    out, lse, noted = call(be, q, k, v, cu_q, cu_k, 0, 3)
    assert out.shape == (0, 2, 128) and lse.shape == (2, 0) and noted == 0
    q, k, v, cu_q, cu_k = make_batch([], [], 3, device=DEV)  # B = 0
    out, lse, noted = call(be, q, k, v, cu_q, cu_k, 0, 0)
    assert out.shape == (0, 3, 128) and lse.shape == (3, 0) and noted == 0 and be.executes == 0


@needs_kernels
@pytest.mark.parametrize("aligned", [True, False], ids=["in_place", "via_copy"])
def test_out_view_honoured(aligned):
    H = 3
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, device=DEV, seed=11)
    Tq = q.shape[0]
    big = torch.full((Tq + 9, H + 1, 160), 7.0, dtype=torch.bfloat16, device=DEV)
    c0 = 16 if aligned else 17  # 17: base not 16-byte aligned, cuDNN cannot write it
    out = big[4 : 4 + Tq, 1:, c0 : c0 + 128]
    assert not out.is_contiguous() and cf._addressable(out) == aligned
    before = big.clone()
    be = EmulatedCudnn()
    got, lse, noted = call(be, q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), out=out)
    assert got is out and got.data_ptr() == out.data_ptr()
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[4 : 4 + Tq, 1:, c0 : c0 + 128] = False
    assert torch.equal(big[mask], before[mask]), "wrote outside the given out view"
    assert be.last_copy == ("" if aligned else "out")
    assert noted == 2 + cf.CUDNN_KERNELS + (0 if aligned else 1)
    fresh, lse2, _ = call(be, q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS))
    assert torch.equal(got, fresh) and torch.equal(lse, lse2)


@needs_kernels
def test_strided_and_misaligned_inputs():
    H = 2
    q, k, v, cu_q, cu_k = make_batch([7, 12], [19, 5], H, device=DEV, seed=5)  # v: tail of a [Tk, H, 256] row
    be = EmulatedCudnn()
    a = call(be, q, k, v, cu_q, cu_k, 12, 19)
    assert be.last_copy == "" and be.seen[-1][0].v_stride == (H * 256, 256)  # v read in place
    qm = torch.zeros(q.numel() + 1, dtype=q.dtype, device=DEV)[1:].view(q.shape)  # 2 bytes off alignment
    qm.copy_(q)
    b = call(be, qm, k, v, cu_q, cu_k, 12, 19)
    assert be.last_copy == "q" and b[2] == a[2] + 1  # copied first, one more launch
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@needs_kernels
def test_graph_cache_buckets_and_lru():
    H = 2
    be = EmulatedCudnn(max_graphs=2)
    run = lambda ql, kl: call(be, *make_batch(ql, kl, H, device=DEV, seed=sum(ql)), max(ql), max(kl))
    run([5, 40], [60, 3])
    assert be.builds == 1
    run([64, 1, 2], [33, 17, 64])  # other lengths, B 3 -> bucket 4 (not 2): a new graph
    assert be.builds == 2
    run([3, 60, 2], [1, 2, 50])  # same buckets as the last: reused
    run([1, 2, 9, 1], [9, 9, 9, 9])  # B 4 -> bucket 4, S 64: reused
    assert be.builds == 2 and len(be.graphs()) == 2
    run([65], [3])  # S_q bucket 128
    assert be.builds == 3 and len(be.graphs()) == 2  # LRU: the first graph went
    assert [(g.B, g.S_q) for g in be.graphs()] == [(4, 64), (1, 128)]
    run([5, 40], [60, 3])  # evicted: built again
    assert be.builds == 4


@needs_kernels
def test_exact_b_when_not_bucketing(monkeypatch):
    monkeypatch.setattr(cf, "BUCKET_B", False)
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, 2, device=DEV, seed=2)
    be = EmulatedCudnn()
    out, lse, _ = call(be, q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS))
    check(out, lse, *reference(q, k, v, cu_q, cu_k, SCALE))
    (key, lq, lk), = be.seen
    assert key.B == 7 and lq == Q_LENS and lk == K_LENS


@needs_kernels
def test_scale_and_causal_are_part_of_the_key():
    be = EmulatedCudnn()
    q, k, v, cu_q, cu_k = make_batch([9], [21], 1, device=DEV, seed=3)
    for causal in (False, True):
        for scale in (0.9, 0.05):
            out, lse, _ = call(be, q, k, v, cu_q, cu_k, 9, 21, causal=causal, scale=scale)
            check(out, lse, *reference(q, k, v, cu_q, cu_k, scale, causal))
    assert be.builds == 4


@needs_kernels
def test_a_failing_build_is_not_retried():
    class Refusing(EmulatedCudnn):
        tries = 0

        def _build(self, key, device):
            Refusing.tries += 1
            raise RuntimeError("cudnnGraphNotSupportedError: no plan\nsecond line")

    be = Refusing()
    q, k, v, cu_q, cu_k = make_batch([9], [21], 1, device=DEV, seed=3)
    with pytest.raises(RuntimeError, match="no plan"):
        be.run_context_chunk(q, k, v, cu_q, cu_k, 9, 21, SCALE)
    with pytest.raises(RuntimeError, match="no graph for .*no plan"):
        be.run_context_chunk(q, k, v, cu_q, cu_k, 9, 21, SCALE)
    assert Refusing.tries == 1 and be.builds == 0


# ----------------------------------------------------------------------------- the real frontend, declared only
def test_declared_pygraph_with_the_real_frontend():
    cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend not installed (a GPU-machine wheel, .whl/)")
    for causal, layout in ((False, "packed"), (True, "padded")):
        key = GraphKey(device="cuda:0", H=16, B=4, S_q=1024, S_kv=2048, q_stride=(3072, 192), k_stride=(3072, 192),
                       v_stride=(4096, 256), o_stride=(2048, 128), scale=0.07, causal=causal, stats_layout=layout)
        g, uids = cf.make_pygraph(cudnn, key)
        assert uids == tuple(cf._UID[n] for n in cf._buffer_names(key))
        spec = graph_spec(key)
        by_uid = {t.uid: t for t in g.tensors.values()}
        for name in cf._buffer_names(key):
            t = by_uid[cf._UID[name]]
            assert tuple(t.dim) == spec[name].dim and tuple(t.stride) == spec[name].stride, name
            assert not t.is_virtual, name
            want = spec[name].ragged
            assert (t.ragged_offset.uid if t.ragged_offset is not None else None) == (cf._UID[want] if want else None)
        (node,) = g.nodes
        p = node.params
        assert p["generate_stats"] is True and p["use_padding_mask"] is True and p["attn_scale"] == 0.07
        assert set(node.inputs) == {"q", "k", "v", "seq_len_q", "seq_len_kv"}
        if causal:
            assert p["diagonal_alignment"] == cudnn.diagonal_alignment.BOTTOM_RIGHT
            assert p["diagonal_band_right_bound"] == 0
        else:
            assert "diagonal_alignment" not in p and "diagonal_band_right_bound" not in p
        g.validate()  # the frontend's own (python) checks; the backend's need a GPU


# ----------------------------------------------------------------------------- auto's probe
class _Fake(AttentionBackend):
    avail = True
    caps = BackendCaps(q_dtypes=frozenset({torch.bfloat16}))

    @classmethod
    def unavailable_reason(cls, device, q_dtype):
        return super().unavailable_reason(device, q_dtype) or (None if cls.avail else f"{cls.name} not here")

    def run_context_chunk(self, *a, **kw):  # pragma: no cover - the measure is faked
        raise AssertionError


def _fakes(monkeypatch, **specs):
    """Register fake backends under the probe's names: name=(ms or an exception, available, dtypes).
    A probe name not given (gluon, unless a test names it) is a fake that is not available."""
    classes = {}
    specs = {name: (0.0, False, BF16) for name in registry._PROBE_FIRST + registry._PROBE_OTHERS} | specs
    for name, (ms, avail, dtypes) in specs.items():
        classes[name] = type(f"Fake_{name}", (_Fake,), dict(name=name, avail=avail, ms=ms,
                                                            caps=BackendCaps(q_dtypes=frozenset(dtypes))))
    real = registry.backend_class

    def backend_class(name):
        if name in classes:
            return classes[name]
        if name in specs:
            raise ImportError(f"{name} missing")
        return real(name)

    monkeypatch.setattr(registry, "backend_class", backend_class)
    measured = []

    def measure(be, device, q_dtype, probe):
        measured.append(be.name)
        if isinstance(be.ms, Exception):
            raise be.ms
        return be.ms

    monkeypatch.setattr(registry, "_measure", measure)
    return measured


PROBE = registry.ProbeShape(heads=16, q_tokens=2048, k_tokens=16384, segments=2)
BF16 = (torch.bfloat16,)


def test_probe_picks_the_fastest(monkeypatch):
    measured = _fakes(monkeypatch, triton=(1.23, True, BF16), **{"cudnn-frontend": (1.05, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)
    assert be.name == "cudnn-frontend" and measured == ["triton", "cudnn-frontend"]
    assert why.startswith("auto: triton 1.230 ms, cudnn-frontend 1.050 ms -> cudnn-frontend"), why
    assert "H=16 2x(1024q/8192k)" in why
    measured.clear()
    _fakes(monkeypatch, triton=(0.9, True, BF16), **{"cudnn-frontend": (1.05, True, BF16)})
    assert registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)[0].name == "triton"


def test_gluon_is_the_first_candidate_where_it_serves(monkeypatch):
    """Where gluon serves (Hopper), it is the candidate the others must beat, statically and
    in the probe; triton, a fallback of the same family, is not timed against it."""
    measured = _fakes(monkeypatch, gluon=(1.0, True, BF16 + (FP8,)), triton=(0.5, True, BF16 + (FP8,)),
                      **{"cudnn-frontend": (0.95, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)
    assert be.name == "gluon" and measured == ["gluon", "cudnn-frontend"], (measured, why)
    assert "10% faster to replace gluon" in why and "triton" not in why, why
    assert registry.create("auto", torch.device("cuda"), torch.bfloat16)[0].name == "gluon"  # no probe shape
    be, why = registry.create("auto", torch.device("cuda"), FP8, probe=PROBE)
    assert be.name == "gluon" and why.startswith("auto: gluon, the only candidate"), why


def test_probe_keeps_the_first_unless_another_is_faster_by_the_margin(monkeypatch):
    # 5 % faster: not enough to replace triton (graph builds per shape bucket are not in the probe)
    _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (0.95, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)
    assert be.name == "triton" and "10% faster to replace triton" in why, why
    _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (0.85, True, BF16)})
    assert registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)[0].name == "cudnn-frontend"


def test_probe_ties_go_to_the_first(monkeypatch):
    _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (1.0, True, BF16)})
    assert registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)[0].name == "triton"


def test_probe_skips_failures_unavailable_and_dtypes(monkeypatch):
    _fakes(monkeypatch, triton=(2.0, True, BF16 + (FP8,)),
           **{"cudnn-frontend": (RuntimeError("no plan\nmore"), True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)
    assert be.name == "triton" and "cudnn-frontend: probe failed (RuntimeError: no plan)" in why, why
    # fp8: cudnn-frontend does not support it, so there is nothing to compare and no probe
    measured = _fakes(monkeypatch, triton=(2.0, True, BF16 + (FP8,)), **{"cudnn-frontend": (1.0, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), FP8, probe=PROBE)
    assert be.name == "triton" and measured == [] and "only candidate" in why and "dtype not supported" in why
    measured = _fakes(monkeypatch, triton=(2.0, False, BF16), **{"cudnn-frontend": (1.0, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)
    assert be.name == "cudnn-frontend" and measured == [] and "triton not here" in why
    _fakes(monkeypatch, triton=(ValueError("x"), True, BF16), **{"cudnn-frontend": (RuntimeError("y"), True, BF16)})
    with pytest.raises(ValueError, match="no attention backend.*probe failed"):
        registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)


def test_probe_not_used_on_cpu_or_without_a_shape(monkeypatch):
    measured = _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (0.5, True, BF16)})
    be, why = registry.create("auto", torch.device("cpu"), torch.bfloat16, probe=PROBE)
    assert measured == [] and be.name == "triton" and why == "auto (skipped gluon: gluon not here)"  # static
    monkeypatch.undo()
    be, why = registry.create("auto", torch.device("cpu"), torch.bfloat16, probe=PROBE)
    assert isinstance(be, ReferenceBackend) and "triton" in why  # CPU: reference, as before
    measured = _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (0.5, True, BF16)})
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16)  # no probe shape: static order
    assert measured == [] and be.name == "triton"


def test_probe_with_the_k_pack_says_so(monkeypatch):
    # the engine passes its K pack when its fused path reads the keys unpacked (bf16 prefill): the
    # measurement (GPU: tests/gpu/test_backend_cudnn_frontend_gpu.py) then times each
    # candidate as that path runs it, and the reason says so
    _fakes(monkeypatch, triton=(1.0, True, BF16), **{"cudnn-frontend": (1.2, True, BF16)})
    shape = dataclasses.replace(PROBE, pack=lambda k_nope, k_pe: None)
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=shape)
    assert be.name == "triton" and "K packed in the timing" in why, why
    assert shape == PROBE  # the pack function is not part of the shape's identity
    assert "K packed" not in registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=PROBE)[1]


def test_probe_shape_validation():
    with pytest.raises(ValueError):
        registry.ProbeShape(heads=0, q_tokens=1, k_tokens=1)
    with pytest.raises(ValueError):
        registry.ProbeShape(heads=1, q_tokens=1, k_tokens=8, segments=2)
