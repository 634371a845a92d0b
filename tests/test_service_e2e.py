"""`ctxprefill serve` as a separate process (CPU), driven through the client package.

For each cache dtype (auto; fp8 with bf16 weights — the seed's crash combination —
and k_scale 0.5; fp8_ds_mla with fp8 weights and fp8 prefill):
- outputs, LSE and stats equal an in-process Engine built from the same settings,
  bit for bit (server-planned, other workspace sizes, an explicit plan);
- ReadCache bytes equal ``encode_slots`` of what was written (CONTRACT §2);
- bad requests get the documented status codes with the field named, and the server
  keeps serving;
- health (overall and per service), reflection, /healthz, /readyz;
- /metrics: kernel launches per stage equal the sum of the requests' Stats (plus one
  insert launch per WriteCache), grpc_server_handled_total per method and code equal
  the calls made;
- ``demo --target`` passes against it;
- SIGTERM with a request in flight: the request completes, the process exits 0
  within the grace period, later requests get UNAVAILABLE; a second SIGTERM cancels
  what is in flight and exits at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ctxprefill.app import build_engine
from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.engine.plan import plan_chunks
from ctxprefill.ops import launches
from ctxprefill.ops.fp8 import FP8
from ctxprefill.ops.slot_format import encode_slots
from ctxprefill.settings import ServeSettings
from ctxprefill_api import pb, pb_grpc
from ctxprefill_bench.remote_demo import run_remote_demo
from ctxprefill_client import (
    FP32,
    ContextChunk,
    CtxPrefillRpcError,
    PrefillContextClient,
    ServerRestartedError,
    float32_to_bf16_bits,
    float32_to_fp8_e4m3_bits,
    slot_mapping,
)
from service_process import ServerProcess, http_get, parse_metrics, sample_sum

SERVICE = "ctxprefill.v1.PrefillContextService"
GRACE = 10.0
COMMON = {"heads": 2, "block_size": 16, "num_blocks": 64, "workspace_tokens": 256, "seed": 3}
CONFIGS = {
    "auto": {"cache_dtype": "auto", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16"},
    "fp8": {"cache_dtype": "fp8", "kv_b_proj_dtype": "bf16", "prefill_dtype": "bf16", "k_scale": 0.5},
    "fp8_ds_mla": {"cache_dtype": "fp8_ds_mla", "kv_b_proj_dtype": "fp8", "prefill_dtype": "fp8"},
}
# the seed's case (CONTRACT §10): continuation chunks, an empty sequence, W = 128
CONTEXTS = [200, 48, 32, 0]
QUERIES = [8, 4, 6, 5]


class Served:
    def __init__(self, name, proc: ServerProcess, flags: dict):
        self.name, self.proc, self.flags = name, proc, flags
        self.settings = ServeSettings(device="cpu", **flags)
        self.engine = build_engine(self.settings)
        self.client = PrefillContextClient(proc.target, timeout=60.0, retries=0)
        self.launches: Counter = Counter()  # stage -> launches the server must have counted
        self.handled: Counter = Counter()  # (method, code) -> RPCs of our service
        self.prefill_stats: list[dict] = []
        self.written_slots: set[int] = set()

    def call(self, method: str, fn, *args, **kw):
        try:
            r = fn(*args, **kw)
        except CtxPrefillRpcError as e:
            self.handled[(method, e.code.name if e.code else "?")] += 1
            raise
        self.handled[(method, "OK")] += 1
        return r

    # -- the workload -----------------------------------------------------------------
    def setup_workload(self):
        cfg = self.engine.config
        bs = cfg.cache.block_size
        g = torch.Generator().manual_seed(11)
        need = [math.ceil(n / bs) for n in CONTEXTS]
        perm = torch.randperm(cfg.cache.num_blocks, generator=g).tolist()
        self.tables, at = [], 0
        for k in need:
            self.tables.append(perm[at : at + k])
            at += k
        self.unused_block = perm[at]
        slots = np.concatenate([slot_mapping(bt, 0, n, bs) for n, bt in zip(CONTEXTS, self.tables) if n])
        T = len(slots)
        # a few tokens skipped with slot -1; large values saturate in fp8
        slots_w = slots.copy()
        skip = np.asarray([T + 1, T + 2])  # extra rows that carry -1
        slots_w = np.concatenate([slots_w, -np.ones(len(skip), dtype=np.int64)])
        kv_c = (torch.randn((len(slots_w), cfg.shape.kv_lora_rank), generator=g) * 2).float()
        k_pe = torch.randn((len(slots_w), cfg.shape.qk_rope_head_dim), generator=g).float()
        kv_c[0, :4] = torch.tensor([1000.0, -1000.0, 3e-9, 0.0])
        self.slots, self.kv_c, self.k_pe, self.slots_w = slots, kv_c[:T], k_pe[:T], slots_w
        n = self.call("WriteCache", self.client.write_cache, slots_w, kv_c.numpy(), k_pe.numpy())
        assert n == T
        counts = Counter()
        with launches.stage(counts, "insert"):
            assert self.engine.write_cache(torch.from_numpy(slots_w), kv_c, k_pe) == T
        self.launches.update(counts)
        self.written_slots.update(slots.tolist())

    def make_q(self, rows: int, seed: int = 5):
        cfg = self.engine.config
        x = torch.randn((rows, cfg.shape.heads, cfg.shape.qk_head_dim), generator=torch.Generator().manual_seed(seed))
        x = x.numpy()
        if cfg.prefill_dtype == "fp8":
            bits = float32_to_fp8_e4m3_bits(x)
            return bits, torch.from_numpy(bits.copy()).view(FP8)
        bits = float32_to_bf16_bits(x)
        return bits, torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)

    def seqs(self):
        return [(q, c, bt) for q, c, bt in zip(QUERIES, CONTEXTS, self.tables)]

    def engine_seqs(self):
        return [SequenceSpec(q, c, bt) for q, c, bt in zip(QUERIES, CONTEXTS, self.tables)]

    def prefill(self, q_bits, **kw):
        res = self.call("PrefillContext", self.client.prefill_context, q_bits, self.seqs(), **kw)
        self.launches.update(res.stats["kernel_launches"])
        self.prefill_stats.append(res.stats)
        return res


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request):
    flags = {**COMMON, **CONFIGS[request.param]}
    proc = ServerProcess(flags, grace_seconds=GRACE)
    s = None
    try:
        proc.wait_ready()
        s = Served(request.param, proc, flags)
        s.info = s.call("GetServerInfo", s.client.server_info)
        s.setup_workload()
        yield s
    finally:
        if s is not None:
            s.client.close()
        proc.terminate(GRACE + 5)
        proc.kill()


def test_server_info(served):
    info = served.info
    cfg = served.engine.config
    assert (info.num_heads, info.kv_lora_rank, info.qk_nope_head_dim, info.qk_rope_head_dim, info.v_head_dim) == (
        2, 512, 128, 64, 128)
    assert info.softmax_scale == pytest.approx(192**-0.5)
    assert info.cache_dtype == cfg.cache.dtype and info.block_size == 16 and info.num_blocks == 64
    assert info.k_scale == cfg.cache.k_scale
    assert info.bytes_per_slot == cfg.cache.bytes_per_slot
    assert info.kv_b_proj_dtype == cfg.kv_b_proj_dtype and info.prefill_dtype == cfg.prefill_dtype
    assert info.kv_b_proj_scale_format == ("block" if cfg.kv_b_proj_dtype == "fp8" else "")
    assert info.weights_source == "random(seed=3)"
    assert info.attention_backend == "reference" and info.attention_backend_supports_out
    assert not info.fused_kernels_active and info.fused_kernels_reason
    assert info.workspace_tokens == 256 and info.device == "cpu"
    assert info.mps_client is None  # unset on a CPU server, read back as None
    assert info.versions["server"] and info.versions["torch"] == torch.__version__
    assert info.max_message_bytes == 1 << 30
    assert len(info.instance_id) >= 16 and info.instance_id != served.engine.instance_id


def test_read_cache_bytes_are_the_slot_format(served):
    cfg = served.engine.config
    raw = served.call("ReadCache", served.client.read_cache, served.slots)
    want = encode_slots(served.kv_c, served.k_pe, cfg.cache.dtype, cfg.cache.k_scale).numpy()
    assert raw.dtype == np.uint8 and raw.shape == (len(served.slots), cfg.cache.bytes_per_slot)
    np.testing.assert_array_equal(raw, want)
    np.testing.assert_array_equal(raw, served.engine.read_cache(torch.from_numpy(served.slots)).numpy())
    # a slot never written reads as zero bytes
    bs = cfg.cache.block_size
    empty = served.call("ReadCache", served.client.read_cache, [served.unused_block * bs + 3])
    assert empty.shape == (1, cfg.cache.bytes_per_slot) and not empty.any()


def _check_equal(served, res, r):
    want_out = r.out.contiguous().view(torch.int16).numpy().view(np.uint16)
    assert res.output_bits is not None
    np.testing.assert_array_equal(res.output_bits, want_out)
    np.testing.assert_array_equal(res.lse.view(np.uint32), r.lse.contiguous().numpy().view(np.uint32))
    st = res.stats
    assert st["kernel_launches"] == {k: v for k, v in r.stats.launches.items() if v}
    assert st["num_chunks"] == len(r.stats.chunks)
    assert [(c.first_sequence, c.context_start, c.context_len) for c in st["chunks"]] == [
        (c.first_sequence, c.context_starts, c.context_lens) for c in r.stats.chunks]
    assert st["path"] == r.stats.path
    assert st["fp8_path"] == r.stats.fp8_path
    assert st["context_tokens"] == sum(CONTEXTS) and st["query_tokens"] == sum(QUERIES)
    assert st["total_nanos"] > 0 and set(st["stage_nanos"]) <= {"gather", "cast", "kv_b_proj", "pack", "attention",
                                                                "merge"}
    # the server's time in parts that add up: nothing counted twice or left out
    ph = st["phase_nanos"]
    assert set(ph) == {"validate", "queue", "input", "compute", "output"}
    assert sum(ph.values()) == st["total_nanos"] and min(ph.values()) >= 0
    assert ph["compute"] > 0 and ph["input"] < 1_000_000  # q inline: nothing to bring in
    assert ph["compute"] >= max(st["stage_nanos"].values())
    # rows of the sequence without context: exactly 0 / -inf
    q0 = sum(QUERIES[:3])
    assert np.all(res.output[q0:] == 0) and np.all(res.lse[:, q0:] == -np.inf)


@pytest.mark.parametrize("mode", ["W=128", "server default W", "explicit plan W=64"])
def test_prefill_bit_exact_vs_in_process_engine(served, mode):
    q_bits, q = served.make_q(sum(QUERIES))
    if mode == "W=128":
        res = served.prefill(q_bits, workspace_tokens=128, request_id="e2e-1")
        r = served.engine.prefill_context(q, served.engine_seqs(), workspace_tokens=128)
        assert res.request_id == "e2e-1" and res.stats["num_chunks"] > 1
    elif mode == "server default W":
        res = served.prefill(q_bits)
        r = served.engine.prefill_context(q, served.engine_seqs())
        assert res.request_id  # made up by the server
    else:
        plan = plan_chunks(CONTEXTS, 64, 16)
        res = served.prefill(q_bits, workspace_tokens=64,
                             plan=[ContextChunk(c.first_sequence, c.num_sequences, c.context_starts, c.context_lens)
                                   for c in plan])
        r = served.engine.prefill_context(q, served.engine_seqs(), workspace_tokens=64, plan=plan)
        assert res.stats["num_chunks"] == len(plan) > 3
    _check_equal(served, res, r)
    assert res.instance_id == served.info.instance_id


def _expect(served, method, code, field, fn, *args, **kw):
    with pytest.raises(CtxPrefillRpcError) as ei:
        served.call(method, fn, *args, **kw)
    assert ei.value.code == code, ei.value
    if field:
        assert field in ei.value.details, ei.value.details
    return ei.value


def test_bad_requests_get_status_codes_and_the_server_goes_on(served):
    c = served.client
    cfg = served.engine.config
    H, D = cfg.shape.heads, cfg.shape.qk_head_dim
    q_bits, q = served.make_q(sum(QUERIES))
    seqs = served.seqs()
    IA, OOR = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE
    # q in the wrong dtype (FP32 instead of BF16 / FP8_E4M3)
    _expect(served, "PrefillContext", IA, "q", c.prefill_context,
            np.zeros((sum(QUERIES), H, D), np.float32), seqs, q_dtype=FP32)
    # q with the wrong head count
    _expect(served, "PrefillContext", IA, "q", c.prefill_context, q_bits[:, :1], seqs)
    # block id out of range
    bad = [list(s) for s in seqs]
    bad[1][2] = [served.tables[1][0], 64, served.tables[1][2]]
    _expect(served, "PrefillContext", OOR, "sequences[1].block_table[1]", c.prefill_context, q_bits, bad)
    # block table too short
    bad = [list(s) for s in seqs]
    bad[0][2] = bad[0][2][:3]
    _expect(served, "PrefillContext", IA, "sequences[0].block_table", c.prefill_context, q_bits, bad)
    # query_len values that do not sum to q's rows
    bad = [list(s) for s in seqs]
    bad[2][0] += 1
    _expect(served, "PrefillContext", IA, "sequences", c.prefill_context, q_bits, bad)
    # negative context_len
    bad = [list(s) for s in seqs]
    bad[3][1] = -1
    _expect(served, "PrefillContext", IA, "sequences[3].context_len", c.prefill_context, q_bits, bad)
    # workspace below one block
    _expect(served, "PrefillContext", IA, "workspace_tokens", c.prefill_context, q_bits, seqs, workspace_tokens=8)
    # a plan that misses tokens
    _expect(served, "PrefillContext", IA, "plan", c.prefill_context, q_bits, seqs,
            plan=[ContextChunk(0, 1, (0,), (16,))])
    _expect(served, "PrefillContext", IA, "plan[0].context_len", c.prefill_context, q_bits, seqs,
            plan=[ContextChunk(0, 2, (0, 0), (16,))])
    # slot out of range (nothing written), -1 is fine
    _expect(served, "WriteCache", OOR, "slot_mapping[1]", c.write_cache, [-1, 64 * 16],
            np.zeros((2, 512), np.float32), np.zeros((2, 64), np.float32))
    _expect(served, "WriteCache", IA, "kv_c", c.write_cache, [0], np.zeros((1, 500), np.float32),
            np.zeros((1, 64), np.float32))
    _expect(served, "ReadCache", OOR, "slot_mapping[0]", c.read_cache, [-1])
    # stale expected_instance_id
    with PrefillContextClient(served.proc.target, retries=0, expected_instance_id="0" * 32) as stale:
        for method, fn, args in (("PrefillContext", stale.prefill_context, (q_bits, seqs)),
                                 ("WriteCache", stale.write_cache, ([0], np.ones((1, 512), np.float32),
                                                                    np.ones((1, 64), np.float32))),
                                 ("ReadCache", stale.read_cache, ([0],))):
            with pytest.raises(ServerRestartedError) as ei:
                served.call(method, fn, *args)
            assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "expected_instance_id" in ei.value.details
    # malformed tensors, through the raw stub
    with grpc.insecure_channel(served.proc.target) as ch:
        stub = pb_grpc.PrefillContextServiceStub(ch)
        wire = pb.DATA_TYPE_FP8_E4M3 if cfg.prefill_dtype == "fp8" else pb.DATA_TYPE_BF16
        req = pb.PrefillContextRequest(q=pb.Tensor(dtype=wire, shape=[1, H, D], data=b"\0" * 7),
                                       sequences=[pb.Sequence(query_len=1, context_len=0)])
        for mutate, field in ((lambda r: None, "q: data has 7 bytes"),
                              (lambda r: setattr(r.q, "dtype", pb.DATA_TYPE_UNSPECIFIED), "q"),
                              (lambda r: r.q.shape.extend([1] * 9), "q"),
                              (lambda r: r.q.shape.__setitem__(0, 2**62), "q")):
            bad_req = pb.PrefillContextRequest()
            bad_req.CopyFrom(req)
            mutate(bad_req)
            with pytest.raises(grpc.RpcError) as ei:
                stub.PrefillContext(bad_req, timeout=10)
            served.handled[("PrefillContext", ei.value.code().name)] += 1
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()
    # nothing was written by the refused writes, and the server still serves, bit for bit
    raw = served.call("ReadCache", c.read_cache, served.slots[:1])
    np.testing.assert_array_equal(raw, served.engine.read_cache(torch.from_numpy(served.slots[:1])).numpy())
    res = served.prefill(q_bits, workspace_tokens=128)
    _check_equal(served, res, served.engine.prefill_context(q, served.engine_seqs(), workspace_tokens=128))


def test_health_and_reflection(served):
    with grpc.insecure_channel(served.proc.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            r = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as ei:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]
        responses = list(refl.ServerReflectionInfo(iter(reqs), timeout=10))
        names = {s.name for s in responses[0].list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names
        assert responses[1].file_descriptor_response.file_descriptor_proto
    assert http_get(served.proc.metrics_url + "/healthz")[0] == 200
    assert http_get(served.proc.metrics_url + "/readyz")[0] == 200
    assert http_get(served.proc.metrics_url + "/nothing-here")[0] == 404


def test_prefill_stream_equals_unary_calls(served):
    """PrefillContextStream through the sync client's PrefillStream: the same answers as
    PrefillContext, in order with several in flight, an in-band error that leaves the
    stream going, and the stream's metrics."""
    q_bits, _ = served.make_q(sum(QUERIES), seed=9)
    want = served.prefill(q_bits, request_id="u-1")
    want_128 = served.prefill(q_bits, workspace_tokens=128)  # another plan: other merges, other bits
    bad = [(QUERIES[0], CONTEXTS[0], [10_000] * len(served.tables[0]))] + served.seqs()[1:]
    got = []
    with served.client.prefill_stream() as s:
        got.append(s.prefill_context(q_bits, served.seqs(), request_id="s-1"))
        s.submit(q_bits, served.seqs(), request_id="s-2")
        s.submit(q_bits, bad, request_id="s-bad")
        s.submit(q_bits, served.seqs(), workspace_tokens=128, request_id="s-3")
        got.append(s.result())
        with pytest.raises(CtxPrefillRpcError) as e:
            s.result()
        assert e.value.code == grpc.StatusCode.OUT_OF_RANGE and "sequences[0].block_table[0]" in e.value.details
        got.append(s.result())
        assert s.in_flight == 0
    assert [r.request_id for r in got] == ["s-1", "s-2", "s-3"]
    for r, w in zip(got, (want, want, want_128)):
        np.testing.assert_array_equal(r.output_bits, w.output_bits)
        np.testing.assert_array_equal(r.lse.view(np.uint32), w.lse.view(np.uint32))
        served.launches.update(r.stats["kernel_launches"])
        served.prefill_stats.append(r.stats)
    assert got[2].stats["num_chunks"] > want.stats["num_chunks"]  # W=128: more chunks, same result
    served.handled[("PrefillContextStream", "OK")] += 1
    m = served.proc.scrape()
    assert sample_sum(m["ctxprefill_stream_requests_total"], grpc_code="OK") == 3
    assert sample_sum(m["ctxprefill_stream_requests_total"], grpc_code="OUT_OF_RANGE") == 1
    lab = {"grpc_service": SERVICE, "grpc_method": "PrefillContextStream", "grpc_type": "bidi_stream"}
    assert sample_sum(m["grpc_server_msg_received_total"], **lab) == 4
    assert sample_sum(m["grpc_server_msg_sent_total"], **lab) == 4


def test_metrics_agree_with_the_requests(served):
    status, text = http_get(served.proc.metrics_url + "/metrics")
    assert status == 200
    m = parse_metrics(text)
    kl = m["ctxprefill_kernel_launches_total"]
    stages = {labels["stage"] for labels, _ in kl}
    assert {"gather", "cast", "kv_b_proj", "pack", "attention", "merge", "insert"} <= stages
    for stage in stages:
        assert sample_sum(kl, stage=stage) == served.launches.get(stage, 0), stage
    assert sample_sum(kl) == sum(served.launches.values()) > 0
    assert {labels["path"] for labels, _ in kl} == {"fused"}
    chunks = sum(s["num_chunks"] for s in served.prefill_stats)
    assert sample_sum(m["ctxprefill_chunks_total"], path="fused") == chunks
    cfg = served.engine.config
    assert sample_sum(m["ctxprefill_fp8_path_total"], **cfg.fp8_path_labels) == chunks
    assert sample_sum(m["ctxprefill_context_tokens_total"]) == sum(s["context_tokens"] for s in served.prefill_stats)
    assert sample_sum(m["ctxprefill_query_tokens_total"]) == sum(s["query_tokens"] for s in served.prefill_stats)
    assert sample_sum(m["ctxprefill_request_duration_seconds_count"]) == len(served.prefill_stats)
    assert sample_sum(m["ctxprefill_stage_duration_seconds_count"], stage="attention") == len(served.prefill_stats)
    assert sample_sum(m["ctxprefill_queue_depth"]) == 0
    assert sample_sum(m["ctxprefill_cache_slots_used"]) == len(served.written_slots)
    assert sample_sum(m["ctxprefill_cache_slots_total"]) == 64 * 16
    assert m["ctxprefill_build_info"] == [({"version": "0.1.0", "backend": "reference", "device": "cpu"}, 1.0)]
    handled = m["grpc_server_handled_total"]
    for (method, code), n in served.handled.items():
        assert sample_sum(handled, grpc_service=SERVICE, grpc_method=method, grpc_code=code) == n, (method, code)
    codes = {labels["grpc_code"] for labels, v in handled if labels["grpc_service"] == SERVICE and v}
    assert {"OK", "INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION"} <= codes
    for method in ("GetServerInfo", "WriteCache", "ReadCache", "PrefillContext"):
        n = sum(v for (mm, _), v in served.handled.items() if mm == method)
        lab = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": "unary"}
        assert sample_sum(m["grpc_server_started_total"], **lab) == n, method
        assert sample_sum(m["grpc_server_msg_received_total"], **lab) == n, method
        assert sample_sum(m["grpc_server_msg_sent_total"], **lab) == served.handled[(method, "OK")], method
        assert sample_sum(m["grpc_server_handling_seconds_count"], **lab) == n, method
    # the health checks and reflection made above are counted too
    assert sample_sum(handled, grpc_service="grpc.health.v1.Health", grpc_method="Check", grpc_code="NOT_FOUND") >= 1
    assert sample_sum(m["grpc_server_started_total"], grpc_type="bidi_stream") >= 1


def test_remote_demo(served, capsys):
    assert run_remote_demo(served.proc.target, served.settings) == 0
    out = capsys.readouterr().out
    assert "error vs float64 within" in out and ": True" in out


def test_sigterm_drains_in_flight_and_exits_zero(served):
    # the demo above overwrote blocks: restore the workload's context (same bytes as in-process)
    served.call("WriteCache", served.client.write_cache, served.slots, served.kv_c.numpy(), served.k_pe.numpy())
    q_bits, q = served.make_q(sum(QUERIES))
    result: dict = {}

    def slow_request():
        try:
            with PrefillContextClient(served.proc.target, retries=0, timeout=60) as c:
                result["res"] = c.prefill_context(q_bits, served.seqs(), workspace_tokens=16)
        except Exception as e:  # noqa: BLE001
            result["err"] = e

    def started() -> float:
        m = served.proc.scrape()
        return sample_sum(m["grpc_server_started_total"], grpc_method="PrefillContext")

    stream = served.client.prefill_stream()  # an open stream ends with UNAVAILABLE on the drain
    stream.prefill_context(q_bits, served.seqs())
    assert stream.is_open
    before = started()
    t = threading.Thread(target=slow_request)
    t.start()
    t_end = time.monotonic() + 20
    while started() == before and time.monotonic() < t_end:
        time.sleep(0.005)
    t0 = time.monotonic()
    rc = served.proc.terminate(GRACE + 5)
    t.join(30)
    assert rc == 0, served.proc.log()
    assert time.monotonic() - t0 < GRACE + 5
    assert "err" not in result, result.get("err")
    r = served.engine.prefill_context(q, served.engine_seqs(), workspace_tokens=16)
    want = r.out.contiguous().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(result["res"].output_bits, want)
    with PrefillContextClient(served.proc.target, retries=0, timeout=5) as c:
        with pytest.raises(CtxPrefillRpcError) as ei:
            c.server_info()
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(CtxPrefillRpcError) as es:
        stream.prefill_context(q_bits, served.seqs())
    assert es.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in es.value.details, es.value
    assert not stream.is_open  # ended by the server: a caller opens a new one
    stream.close()
    log = served.proc.log()
    assert '"msg": "draining"' in log and '"msg": "stopped"' in log


def test_a_second_sigterm_cuts_the_grace_period_short():
    """Draining waits for the request in flight; a second SIGTERM stops at once: that request
    is cancelled (its chunk loop stops at its next chunk) and the process exits 0, long
    before its 600 s grace would end."""
    import signal

    nb = 40000  # one 640k-token context in 10,000 chunks of 64: several seconds on the CPU
    with ServerProcess({"heads": 1, "block_size": 16, "num_blocks": nb + 1, "workspace_tokens": 64},
                       grace_seconds=600) as p:
        result: dict = {}

        def slow_request():
            try:
                with PrefillContextClient(p.target, retries=0, timeout=600) as c:
                    result["res"] = c.prefill_context(np.zeros((4, 1, 192), np.uint16), [(4, 16 * nb, range(nb))])
            except Exception as e:  # noqa: BLE001
                result["err"] = e

        t = threading.Thread(target=slow_request)
        t.start()
        t_end = time.monotonic() + 60
        while not sample_sum(p.scrape()["grpc_server_started_total"], grpc_method="PrefillContext"):
            assert time.monotonic() < t_end
            time.sleep(0.01)
        time.sleep(0.5)  # admitted and running (its check takes milliseconds, its work seconds)
        p.proc.send_signal(signal.SIGTERM)
        while '"draining"' not in p.log() and time.monotonic() < t_end:
            time.sleep(0.01)
        assert p.proc.poll() is None  # draining: the request is still running
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(timeout=60) == 0, p.log()
        t.join(60)
        assert "res" not in result and isinstance(result.get("err"), CtxPrefillRpcError), result
        assert "second signal: cutting the grace period short" in p.log()
