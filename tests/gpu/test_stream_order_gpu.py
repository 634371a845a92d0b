"""Stream-ordered request rings on the GPU (docs/TRANSPORT.md, service/stream_order.py).

A ``ctxprefill serve --request-ring --request-ring-stream-order`` subprocess (eager and
with CUDA graphs); this process is the caller, its tensors in CUDA regions. What is
shown: the server answers while the caller's stream is still busy (no host waits for
it), its work reads q as the caller's stream left it (written after a long sleep
kernel, never the value before), the caller's stream reads the results only after the
server's work (a clone queued right after ``result()`` sees them, not the NaN fill),
a chain of requests whose q is written on the stream after the one before reuses
every slot and equals inline calls bit for bit, and host-memory tensors are refused
in-band naming their field while the ring goes on.
"""

from __future__ import annotations

import os
import sys

import grpc
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# the transport tests' small workload: 4 sequences (one without context) over a 16-token-block cache
from test_transport_gpu import BS, NB, SEQS, SLOTS, TQ, D, H, L, R, V  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: stream-ordered rings run on the GPU machine")]

SLEEP_CYCLES = 2_000_000_000  # ~1 s of the caller's stream at the H200's clock: the answer comes well before


@pytest.fixture(scope="module", params=["eager", "graphs"])
def served(request, cuda_ext):
    from ctxprefill_client import PrefillContextClient
    from service_process import ServerProcess

    flags = {"device": f"cuda:{torch.cuda.current_device()}", "heads": H, "block_size": BS, "num_blocks": NB,
             "workspace_tokens": 64, "seed": 9, "shared_memory": "all", "request_ring": True,
             "request_ring_stream_order": True, "cuda_graphs": request.param == "graphs"}
    proc = ServerProcess(flags)
    try:
        proc.wait_ready(timeout=600)
        with PrefillContextClient(proc.target, retries=0, timeout=120) as c:
            assert c.server_info().request_ring_stream_order
            rng = np.random.default_rng(3)
            c.write_cache(SLOTS, rng.standard_normal((len(SLOTS), L), dtype=np.float32),
                          rng.standard_normal((len(SLOTS), R), dtype=np.float32))
            yield c
    finally:
        proc.terminate(30)
        proc.kill()


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()


class Setup:
    """q / out / lse as CUDA regions and a stream-ordered ring in system shared memory."""

    def __init__(self, c, num_slots: int):
        import ctxprefill_client as cc

        self.c, self.dev = c, torch.device("cuda", torch.cuda.current_device())
        self.q = torch.zeros((TQ, H, D), dtype=torch.bfloat16, device=self.dev)
        self.out = torch.full((TQ, H, V), float("nan"), dtype=torch.bfloat16, device=self.dev)
        self.lse = torch.full((H, TQ), float("nan"), dtype=torch.float32, device=self.dev)
        self.regions = [cc.CudaSharedMemoryRegion(n, t) for n, t in (("q", self.q), ("out", self.out),
                                                                        ("lse", self.lse))]
        for r in self.regions:
            c.register_cuda_shared_memory(r)
        self.shm = cc.SystemSharedMemoryRegion("ring", cc.RequestRing.bytes_needed(num_slots, 1 << 16))
        c.register_system_shared_memory(self.shm)
        torch.cuda.synchronize()
        self.ring = c.attach_request_ring(self.shm, num_slots=num_slots, slot_bytes=1 << 16, stream_ordered=True,
                                          timeout=120)

    def kw(self):
        return {"output_region": self.regions[1].ref(), "lse_region": self.regions[2].ref(), "float_output": False}

    def reference(self, q: torch.Tensor):
        """The same request inline (a plain call): output and LSE bits."""
        import ctxprefill_client as cc

        bits = q.cpu().view(torch.int16).numpy().view(np.uint16)
        r = self.c.prefill_context(bits, SEQS, q_dtype=cc.BF16)
        return r.output_bits.view(np.int16), r.lse.view(np.int32)

    def close(self):
        self.ring.close()
        torch.cuda.synchronize()
        for name in ("q", "out", "lse", "ring"):
            self.c.unregister_shared_memory(name)
        for r in self.regions:
            r.close()
        self.shm.close()
        self.shm.unlink()


def test_the_server_waits_on_the_device_and_answers_before_the_callers_stream_gets_there(served):
    s = Setup(served, num_slots=2)
    try:
        g = torch.Generator(device=s.dev).manual_seed(5)
        q_old = torch.randn((TQ, H, D), generator=g, device=s.dev).to(torch.bfloat16)
        q_new = torch.randn((TQ, H, D), generator=g, device=s.dev).to(torch.bfloat16)
        ref_new = s.reference(q_new)
        ref_old = s.reference(q_old)
        assert not np.array_equal(ref_new[0], ref_old[0])
        s.q.copy_(q_old)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy ...
        s.q.copy_(q_new)  # ... and writes q only then
        s.ring.submit(s.regions[0].input(), SEQS, **s.kw())
        reached = torch.cuda.Event()
        reached.record()  # the caller's stream past the request's ready event
        res = s.ring.result()
        assert not reached.query(), "the answer waited for the caller's stream"
        assert res.stats["queued"] and res.stats["stage_nanos"] == {}
        snap_out, snap_lse = s.out.clone(), s.lse.clone()  # queued behind the slot's done event
        torch.cuda.synchronize()
        assert np.array_equal(_bits(snap_out), ref_new[0]) and np.array_equal(_bits(snap_lse), ref_new[1])
    finally:
        s.close()


def test_a_chain_of_requests_on_the_stream_equals_inline_calls(served):
    s = Setup(served, num_slots=2)
    try:
        g = torch.Generator(device=s.dev).manual_seed(6)
        qs = [torch.randn((TQ, H, D), generator=g, device=s.dev).to(torch.bfloat16) for _ in range(6)]
        refs = [s.reference(q) for q in qs]
        torch.cuda.synchronize()
        outs = []
        for q in qs:
            # each q is written on the stream after the answer before (its done event waited for)
            torch.cuda._sleep(SLEEP_CYCLES // 500)  # ~2 ms
            s.q.copy_(q)
            s.ring.submit(s.regions[0].input(), SEQS, **s.kw())
            assert s.ring.result().stats["queued"]
            outs.append((s.out.clone(), s.lse.clone()))
        torch.cuda.synchronize()
        for (o, lse), (ro, rl) in zip(outs, refs, strict=True):
            assert np.array_equal(_bits(o), ro) and np.array_equal(_bits(lse), rl)
    finally:
        s.close()


def test_host_memory_is_refused_in_band_and_the_ring_goes_on(served):
    import ctxprefill_client as cc

    s = Setup(served, num_slots=2)
    try:
        q_bits = np.zeros((TQ, H, D), np.uint16)
        with pytest.raises(cc.CtxPrefillRpcError) as e:
            s.ring.submit(q_bits, SEQS, q_dtype=cc.BF16, **s.kw())
            s.ring.result()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "q" in e.value.details
        with pytest.raises(cc.CtxPrefillRpcError) as e:
            s.ring.submit(s.regions[0].input(), SEQS, float_output=False)  # results inline
            s.ring.result()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "output_region" in e.value.details
        q = torch.randn((TQ, H, D), device=s.dev).to(torch.bfloat16)
        ref = s.reference(q)
        s.q.copy_(q)
        s.ring.submit(s.regions[0].input(), SEQS, **s.kw())
        s.ring.result()
        torch.cuda.synchronize()
        assert np.array_equal(_bits(s.out), ref[0])
    finally:
        s.close()
