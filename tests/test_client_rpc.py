"""The sync and asyncio clients against an in-process fake server (numpy, float64
math, bf16 cache): retries, deadlines, auth metadata, instance-id tracking, message
limits, and the example orchestrator end to end. The real server has its own e2e tests;
this pins the client's side of the contract without torch or a GPU."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent import futures

import grpc
import numpy as np
import pytest

from ctxprefill_api import pb, pb_grpc
from ctxprefill_client import (
    AsyncPrefillContextClient,
    ContextChunk,
    CtxPrefillRpcError,
    PrefillContextClient,
    RawTensor,
    Sequence,
    ServerRestartedError,
    bf16_bits_to_float32,
    decode_tensor,
    encode_tensor,
    float32_to_bf16_bits,
)
from ctxprefill_client import tensors as T
from ctxprefill_client.examples import orchestrator

H, L, P, R, V = 2, 512, 128, 64, 128
BLOCK, NBLOCKS = 16, 64


class FakeServicer(pb_grpc.PrefillContextServiceServicer):
    """bf16 ("auto") cache, reference math in float64, output rounded to bf16."""

    def __init__(self, w_deq: np.ndarray) -> None:
        self.w = w_deq
        self.instance_id = uuid.uuid4().hex
        self.cache = np.zeros((NBLOCKS * BLOCK, L + R), dtype=np.uint16)
        self.fail_next: list[grpc.StatusCode] = []
        self.calls: dict[str, int] = {}
        self.metadata: list[dict[str, str]] = []
        self.sleep_s = 0.0
        self.lock = threading.Lock()

    def _enter(self, name, request, context):
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.metadata.append(dict(context.invocation_metadata()))
            code = self.fail_next.pop(0) if self.fail_next else None
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if code is not None:
            context.abort(code, f"injected {code.name}")
        if request is not None and request.HasField("expected_instance_id"):
            if request.expected_instance_id != self.instance_id:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "expected_instance_id: server restarted")

    def _decode(self, msg, name, context, **kw):
        try:
            return decode_tensor(msg, name=name, **kw)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def GetServerInfo(self, request, context):
        self._enter("GetServerInfo", None, context)
        return pb.GetServerInfoResponse(
            instance_id=self.instance_id, num_heads=H, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R,
            v_head_dim=V, softmax_scale=(P + R) ** -0.5, cache_dtype="auto", block_size=BLOCK,
            num_blocks=NBLOCKS, k_scale=1.0, bytes_per_slot=2 * (L + R), kv_b_proj_dtype="bf16",
            prefill_dtype="bf16", attention_backend="fake", attention_backend_supports_out=False,
            fused_kernels_active=False, fused_kernels_reason="fake", workspace_tokens=128, device="cpu",
            versions=pb.Versions(server="fake"), max_message_bytes=64 << 20,
        )  # fmt: skip

    def WriteCache(self, request, context):
        self._enter("WriteCache", request, context)
        slots = self._decode(request.slot_mapping, "slot_mapping", context, dtypes=(T.INT64,), ndim=1).bits
        kv_c = self._decode(request.kv_c, "kv_c", context, dtypes=(T.BF16, T.FP32), ndim=2)
        k_pe = self._decode(request.k_pe, "k_pe", context, dtypes=(T.BF16, T.FP32), ndim=2)
        if np.any((slots < -1) | (slots >= NBLOCKS * BLOCK)):
            context.abort(grpc.StatusCode.OUT_OF_RANGE, "slot_mapping: slot out of range")

        def bits(raw):
            return raw.bits if raw.dtype == T.BF16 else float32_to_bf16_bits(raw.bits)

        rows = np.concatenate([bits(kv_c), bits(k_pe)], axis=1)
        keep = slots >= 0
        self.cache[slots[keep]] = rows[keep]
        return pb.WriteCacheResponse(slots_written=int(keep.sum()), instance_id=self.instance_id)

    def ReadCache(self, request, context):
        self._enter("ReadCache", request, context)
        slots = self._decode(request.slot_mapping, "slot_mapping", context, dtypes=(T.INT64,), ndim=1).bits
        if np.any((slots < 0) | (slots >= NBLOCKS * BLOCK)):
            context.abort(grpc.StatusCode.OUT_OF_RANGE, "slot_mapping: slot out of range")
        raw = np.ascontiguousarray(self.cache[slots]).view(np.uint8)
        return pb.ReadCacheResponse(slots=encode_tensor(raw, T.UINT8), instance_id=self.instance_id)

    def PrefillContext(self, request, context):
        self._enter("PrefillContext", request, context)
        t0 = time.perf_counter_ns()
        q = self._decode(request.q, "q", context, dtypes=(T.BF16,), ndim=3).to_numpy().astype(np.float64)
        tq = sum(s.query_len for s in request.sequences)
        if q.shape != (tq, H, P + R):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "q: shape does not match sequences")
        out = np.zeros((tq, H, V))
        lse = np.full((H, tq), -np.inf)
        row = 0
        for s in request.sequences:
            rows = slice(row, row + s.query_len)
            cl = s.context_len
            if cl:
                bt = np.asarray(s.block_table, dtype=np.int64)
                slots = bt.repeat(BLOCK)[:cl] * BLOCK + np.arange(cl) % BLOCK
                vals = bf16_bits_to_float32(self.cache[slots]).astype(np.float64)
                kv = (vals[:, :L] @ self.w.T).reshape(cl, H, P + V)
                k = np.concatenate([kv[:, :, :P], np.broadcast_to(vals[:, None, L:], (cl, H, R))], -1)
                o, lz = orchestrator.attention_f64(q[rows], k, kv[:, :, P:], (P + R) ** -0.5)
                out[rows], lse[:, rows] = o, lz
            row += s.query_len
        plan = list(request.plan) or [
            pb.ContextChunk(first_sequence=0, num_sequences=len(request.sequences),
                            context_start=[0] * len(request.sequences),
                            context_len=[s.context_len for s in request.sequences])
        ]  # fmt: skip
        stats = pb.Stats(
            num_chunks=len(plan), chunks=plan, kernel_launches={"gather": 1, "attention": 1}, path="generic",
            fp8_path=pb.Fp8Path(cache_dtype="auto", kv_b_proj_dtype="bf16", prefill_dtype="bf16"),
            stage_nanos={"attention": 5}, total_nanos=time.perf_counter_ns() - t0,
            context_tokens=sum(s.context_len for s in request.sequences), query_tokens=tq,
        )  # fmt: skip
        return pb.PrefillContextResponse(
            output=encode_tensor(out.astype(np.float32), T.BF16),
            lse=encode_tensor(lse.astype(np.float32)),
            stats=stats,
            instance_id=self.instance_id,
            request_id=request.request_id or "made-up",
        )


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "kv_b_proj.safetensors"
    orchestrator.make_random_weights(str(path), H, seed=3)
    return str(path)


@pytest.fixture
def fake(weights_file):
    servicer = FakeServicer(orchestrator.load_kv_b_proj(weights_file))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
    )
    pb_grpc.add_PrefillContextServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _client(target, **kw):
    kw.setdefault("timeout", 10)
    kw.setdefault("backoff_base", 0.001)
    kw.setdefault("backoff_max", 0.005)
    return PrefillContextClient(target, **kw)


def test_server_info_and_instance_tracking(fake):
    servicer, target = fake
    with _client(target) as c:
        assert c.instance_id is None
        info = c.server_info()
        assert info.num_heads == H and info.num_slots == NBLOCKS * BLOCK and info.qk_head_dim == P + R
        assert info.versions["server"] == "fake"
        assert c.instance_id == servicer.instance_id


def test_write_read_round_trip_and_expected_instance_sent(fake):
    servicer, target = fake
    rng = np.random.default_rng(0)
    with _client(target) as c:
        c.server_info()
        kv_c = rng.standard_normal((5, L)).astype(np.float32)
        k_pe = rng.standard_normal((5, R)).astype(np.float32)
        slots = np.array([3, -1, 17, 1023, 0])
        assert c.write_cache(slots, kv_c, k_pe) == 4
        raw = c.read_cache([3, 17, 1023, 0])
        assert raw.shape == (4, 2 * (L + R)) and raw.dtype == np.uint8
        got = raw.copy().view("<u2")
        keep = slots >= 0
        np.testing.assert_array_equal(got[:, :L], float32_to_bf16_bits(kv_c[keep]))
        np.testing.assert_array_equal(got[:, L:], float32_to_bf16_bits(k_pe[keep]))
        # bf16 bits travel as BF16
        assert c.write_cache([5], RawTensor(T.BF16, got[:1, :L]), got[:1, L:]) == 1
        assert np.array_equal(c.read_cache([5]), raw[:1])


def test_retries_unavailable_then_succeeds(fake):
    servicer, target = fake
    servicer.fail_next = [grpc.StatusCode.UNAVAILABLE] * 2
    with _client(target, retries=3) as c:
        c.server_info()
    assert servicer.calls["GetServerInfo"] == 3


def test_retries_exhausted_raise_unavailable(fake):
    servicer, target = fake
    servicer.fail_next = [grpc.StatusCode.UNAVAILABLE] * 5
    with _client(target, retries=1) as c, pytest.raises(CtxPrefillRpcError) as ei:
        c.server_info()
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["GetServerInfo"] == 2


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL]
)
def test_no_retry_on_other_codes(fake, code):
    servicer, target = fake
    servicer.fail_next = [code]
    with _client(target, retries=3) as c, pytest.raises(CtxPrefillRpcError) as ei:
        c.server_info()
    assert ei.value.code == code and not isinstance(ei.value, ServerRestartedError)
    assert servicer.calls["GetServerInfo"] == 1


def test_server_validation_error_surfaces_with_field(fake):
    servicer, target = fake
    with _client(target) as c, pytest.raises(CtxPrefillRpcError) as ei:
        c.write_cache([NBLOCKS * BLOCK], np.zeros((1, L), np.float32), np.zeros((1, R), np.float32))
    assert ei.value.code == grpc.StatusCode.OUT_OF_RANGE and "slot_mapping" in ei.value.details


def test_deadline_exceeded_is_not_retried(fake):
    servicer, target = fake
    servicer.sleep_s = 0.5
    with _client(target, retries=3) as c, pytest.raises(CtxPrefillRpcError) as ei:
        c.server_info(timeout=0.1)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.6)
    assert servicer.calls["GetServerInfo"] == 1


def test_restart_detected(fake):
    servicer, target = fake
    with _client(target) as c:
        old = c.server_info().instance_id
        servicer.instance_id = uuid.uuid4().hex  # "restart": the cache is gone
        with pytest.raises(ServerRestartedError) as ei:
            c.write_cache([1], np.zeros((1, L), np.float32), np.zeros((1, R), np.float32))
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert ei.value.expected_instance_id == old
        with pytest.raises(ServerRestartedError):
            c.prefill_context(np.zeros((1, H, P + R), np.float32), [(1, 0, [])])
        with pytest.raises(ServerRestartedError) as ei:
            c.server_info()
        assert ei.value.actual_instance_id == servicer.instance_id
        c.reset_instance()
        assert c.server_info().instance_id == servicer.instance_id
        assert c.write_cache([1], np.zeros((1, L), np.float32), np.zeros((1, R), np.float32)) == 1


def test_untracked_client_sends_no_expected_id(fake):
    servicer, target = fake
    with _client(target, track_instance=False) as c:
        c.server_info()
        servicer.instance_id = "other"
        assert c.write_cache([1], np.zeros((1, L), np.float32), np.zeros((1, R), np.float32)) == 1
        assert c.instance_id is None


def test_token_and_metadata_sent(fake):
    servicer, target = fake
    with _client(target, token="s3cret", metadata=[("x-tenant", "a")]) as c:
        c.server_info()
    md = servicer.metadata[-1]
    assert md["authorization"] == "Bearer s3cret" and md["x-tenant"] == "a"


def test_message_size_limit_from_channel_options(fake):
    servicer, target = fake
    with _client(target, max_message_bytes=1 << 16) as c, pytest.raises(CtxPrefillRpcError) as ei:
        c.write_cache(np.arange(64), np.zeros((64, L), np.float32), np.zeros((64, R), np.float32))
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.calls.get("WriteCache", 0) == 0


def test_prefill_context_result_and_plan(fake):
    servicer, target = fake
    rng = np.random.default_rng(1)
    with _client(target) as c:
        c.server_info()
        c.write_cache(np.arange(40), rng.standard_normal((40, L)) * 0.05, rng.standard_normal((40, R)))
        q = rng.standard_normal((5, H, P + R)).astype(np.float32)
        plan = [ContextChunk(0, 1, (0,), (32,)), ContextChunk(0, 2, (32,), (8, 0))]
        res = c.prefill_context(q, [Sequence(3, 40, (0, 1, 2)), (2, 0, [])], request_id="r1", plan=plan,
                                workspace_tokens=64)  # fmt: skip
    assert res.output.shape == (5, H, V) and res.output.dtype == np.float32
    assert res.output_bits.dtype == np.uint16
    np.testing.assert_array_equal(bf16_bits_to_float32(res.output_bits), res.output)
    assert res.lse.shape == (H, 5) and res.lse.dtype == np.float32
    assert np.all(res.output[3:] == 0) and np.all(res.lse[:, 3:] == -np.inf)
    assert np.all(np.isfinite(res.lse[:, :3]))
    assert res.request_id == "r1" and res.instance_id == servicer.instance_id
    assert res.stats["num_chunks"] == 2 and res.stats["chunks"] == plan
    assert res.stats["kernel_launches"] == {"gather": 1, "attention": 1}
    assert res.stats["fp8_path"]["cache_dtype"] == "auto" and res.stats["query_tokens"] == 5


def test_orchestrator_example_end_to_end(fake, weights_file):
    servicer, target = fake
    lines = []
    with _client(target) as c:
        report = orchestrator.run(
            c, orchestrator.load_kv_b_proj(weights_file), context_lens=[200, 48, 32, 0], query_lens=[8, 4, 6, 5],
            log=lines.append,
        )  # fmt: skip
    assert report["ok"], lines
    assert report["rel_err"] < 2e-2 and report["lse_abs_err"] < 2e-2
    assert any("merged vs full attention" in line for line in lines)
    rc = orchestrator.main(["--target", target, "--weights", weights_file, "--context-lens", "17,0,64",
                            "--query-lens", "3,2,1", "--seed", "5"])  # fmt: skip
    assert rc == 0


def test_orchestrator_detects_wrong_weights(fake, tmp_path):
    servicer, target = fake
    other = tmp_path / "other.safetensors"
    orchestrator.make_random_weights(str(other), H, seed=99)
    rc = orchestrator.main(["--target", target, "--weights", str(other), "--context-lens", "40", "--query-lens", "4"])
    assert rc == 1


def test_async_client(fake):
    servicer, target = fake

    async def main():
        servicer.fail_next = [grpc.StatusCode.UNAVAILABLE]
        async with AsyncPrefillContextClient(target, timeout=10, backoff_base=0.001, token="t") as c:
            info = await c.server_info()
            assert info.num_heads == H and c.instance_id == servicer.instance_id
            rng = np.random.default_rng(2)
            kv = rng.standard_normal((20, L)).astype(np.float32) * 0.05
            assert await c.write_cache(np.arange(20), kv, np.zeros((20, R), np.float32)) == 20
            raw = await c.read_cache(np.arange(20))
            np.testing.assert_array_equal(raw.copy().view("<u2")[:, :L], float32_to_bf16_bits(kv))
            res = await c.prefill_context(rng.standard_normal((4, H, P + R)), [(4, 20, [0, 1])])
            assert res.output.shape == (4, H, V) and np.all(np.isfinite(res.lse))
            servicer.instance_id = "restarted"
            with pytest.raises(ServerRestartedError):
                await c.prefill_context(np.zeros((1, H, P + R)), [(1, 0, [])])
            servicer.fail_next = [grpc.StatusCode.INVALID_ARGUMENT]
            c.reset_instance()
            with pytest.raises(CtxPrefillRpcError) as ei:
                await c.server_info()
            assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(main())
    assert servicer.calls["GetServerInfo"] == 3
    assert servicer.metadata[-1]["authorization"] == "Bearer t"


def test_bad_response_is_reported():
    """A response whose tensors do not match the contract raises ResponseDecodeError."""
    from ctxprefill_client import ResponseDecodeError
    from ctxprefill_client._common import parse_prefill_response

    resp = pb.PrefillContextResponse(
        output=encode_tensor(np.zeros((3, H, V), np.float32), T.BF16),
        lse=encode_tensor(np.zeros((3, H), np.float32)),  # [T, H]: the wrong layout
    )
    with pytest.raises(ResponseDecodeError, match="lse"):
        parse_prefill_response(resp, 3)
    with pytest.raises(ResponseDecodeError, match="output: 3 rows"):
        parse_prefill_response(resp, 4)
    resp.output.data = resp.output.data[:-2]
    with pytest.raises(ResponseDecodeError, match="^output: data has"):
        parse_prefill_response(resp, 3)


def test_a_placement_the_request_did_not_ask_for_is_reported():
    """Results the server says it wrote into shared memory are read only where the request
    offered them: not asked for, another region or offset, more bytes than offered, or a
    size that disagrees with the shape all raise ResponseDecodeError naming the tensor."""
    from ctxprefill_client import ResponseDecodeError, SharedMemoryRef
    from ctxprefill_client._common import parse_prefill_response

    out_bytes = 3 * H * V * 2
    asked = SharedMemoryRef("r", 4096, out_bytes)

    def resp(region="r", offset=4096, nbytes=out_bytes, shape=(3, H, V), dtype=T.BF16):
        out = pb.Tensor(dtype=dtype, shape=list(shape))
        out.shared_memory.region, out.shared_memory.offset, out.shared_memory.byte_size = region, offset, nbytes
        return pb.PrefillContextResponse(output=out, lse=encode_tensor(np.zeros((H, 3), np.float32)))

    res = parse_prefill_response(resp(), 3, output_region=asked)  # as asked: a reference (no local region)
    assert res.output_ref.region == "r" and res.output_ref.byte_size == out_bytes and res.output_bits is None
    for r, offered, needle in (
        (resp(), None, "the request did not ask for that"),
        (resp(region="other"), asked, "written to 'other' at 4096"),
        (resp(offset=0), asked, "at 0, asked for 'r' at 4096"),
        (resp(nbytes=out_bytes - 2), asked, f"{out_bytes - 2} bytes written"),
        (resp(shape=(4, H, V), nbytes=4 * H * V * 2), SharedMemoryRef("r", 4096, out_bytes), "were offered"),
        (resp(dtype=T.FP32), asked, "unexpected dtype"),
    ):
        with pytest.raises(ResponseDecodeError, match=f"^output: .*{needle}"):
            parse_prefill_response(r, 3, output_region=offered)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_ds_mla"])
def test_orchestrator_reads_every_cache_layout(cache_dtype):
    """Slot bytes built with torch per CONTRACT §2 decode to the right values in the example."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    t, k_scale = 9, (0.5 if cache_dtype == "fp8" else 1.0)
    c = torch.from_numpy(rng.standard_normal((t, L)).astype(np.float32) * 3).to(torch.bfloat16)
    c[0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-6])
    kpe = torch.from_numpy(rng.standard_normal((t, R)).astype(np.float32)).to(torch.bfloat16)
    c_bits = c.view(torch.int16).numpy().view(np.uint16)
    kpe_bits = kpe.view(torch.int16).numpy().view(np.uint16)

    def sat(x):
        return x.clamp(-448, 448).to(torch.float8_e4m3fn)

    if cache_dtype == "auto":
        raw = torch.cat([c, kpe], 1).view(torch.uint8).numpy()
        want_c, want_kpe = c.double().numpy(), kpe.double().numpy()
    elif cache_dtype == "fp8":
        q = sat(torch.cat([c, kpe], 1).float() / k_scale)
        raw = q.view(torch.uint8).numpy()
        deq = q.double().numpy() * k_scale
        want_c, want_kpe = deq[:, :L], deq[:, L:]
    else:
        tiles = c.float().view(t, 4, 128)
        amax = tiles.abs().amax(-1)
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=1e-4))))
        q = sat(tiles / scale[..., None])
        raw = torch.cat(
            [q.view(t, L).view(torch.uint8), scale.contiguous().view(torch.uint8), kpe.view(torch.uint8)], 1
        ).numpy()
        want_c = (q.float() * scale[..., None]).view(t, L).to(torch.bfloat16).double().numpy()
        want_kpe = kpe.double().numpy()
    assert raw.shape == (t, {"auto": 1152, "fp8": 576, "fp8_ds_mla": 656}[cache_dtype])
    got_c, got_kpe = orchestrator.dequantize_slots(raw, cache_dtype, L, R, k_scale)
    np.testing.assert_array_equal(got_c, want_c)
    np.testing.assert_array_equal(got_kpe, want_kpe)
    assert orchestrator.check_cache_bytes(raw, cache_dtype, c_bits, kpe_bits, k_scale) == 0
    bad = raw.copy()
    bad[1, -1] ^= 1
    assert orchestrator.check_cache_bytes(bad, cache_dtype, c_bits, kpe_bits, k_scale) == 1
