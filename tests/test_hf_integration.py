"""ctxprefill inside a real model's forward pass: a transformers DeepSeek-V3 model (random
weights, the real architecture: q LoRA, kv_a latent + kv_a_layernorm, kv_b_proj, YaRN RoPE
with mscale_all_dim) prefilled chunk by chunk through
``ctxprefill_client.integrations.transformers_deepseek``, every layer's attention over the
earlier chunks computed by a ``ctxprefill serve --model DIR`` process serving the saved
checkpoint (several safetensors shards), against transformers' own forward of the whole prompt.

"Relative" error throughout: ``‖a − b‖ / ‖b‖`` (Frobenius, float32) of the chunked result
``a`` against the monolithic one ``b``, per layer for the attention outputs (``self_attn``'s
output, o_proj included, of both prompts) and over the logits of both prompts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[test])")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

from ctxprefill_bench import deepseek_model  # noqa: E402
from ctxprefill_bench.deepseek_model import capture, rel  # noqa: E402
from ctxprefill_client import (  # noqa: E402
    PrefillContextClient,
    ServerRestartedError,
    ShardedPrefillClient,
    merge_partials,
)
from ctxprefill_client.integrations.transformers_deepseek import (  # noqa: E402
    BlockAllocator,
    DeepseekV3ChunkedPrefill,
    IncompatibleServerError,
    OutOfBlocksError,
    merge_partials_torch,
)
from service_process import ServerProcess, env_with_sources  # noqa: E402

LAYERS, HEADS, PROMPT, CHUNK = 3, 2, 96, 24  # 24: chunks start and end inside 16-token blocks
BLOCK_SIZE, NUM_BLOCKS = 16, 32
BF16_TOL = {"attention": 1e-2, "logits": 2e-2}
FP8_TOL = {"attention": 5e-2, "logits": 6e-2}


def make_config() -> Any:
    return deepseek_model.make_config(layers=LAYERS, heads=HEADS, hidden=64, q_lora_rank=96, intermediate=128,
                                      vocab=256, original_max_positions=128)


def make_model() -> DeepseekV3ForCausalLM:
    return deepseek_model.make_model(make_config(), seed=0)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 per 128×128 block, DeepSeek-V3's layout: (weight, weight_scale_inv
    [ceil(N/128), ceil(L/128)] float32), W ≈ weight * scale_inv per block."""
    n, k = w.shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    pad = torch.zeros((nb * 128, kb * 128))
    pad[:n, :k] = w.float()
    scale = (pad.reshape(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def kv_b_key(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def to_fp8_checkpoint(src: str, dst: str) -> dict[int, torch.Tensor]:
    """Copy checkpoint ``src`` to ``dst`` with every kv_b_proj stored fp8 + weight_scale_inv, as
    published checkpoints store them; returns each layer's dequantized weight (bf16)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    deq: dict[int, torch.Tensor] = {}
    for fname in sorted({index["weight_map"][kv_b_key(i)] for i in range(LAYERS)}):
        path = os.path.join(dst, fname)
        tensors = load_file(path)
        for i in range(LAYERS):
            if index["weight_map"][kv_b_key(i)] == fname:
                q, s = quantize_blocks(tensors[kv_b_key(i)])
                tensors[kv_b_key(i)] = q
                tensors[kv_b_key(i) + "_scale_inv"] = s
                index["weight_map"][kv_b_key(i) + "_scale_inv"] = fname
                deq[i] = dequantize_blocks(q, s).to(torch.bfloat16)
        save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return deq


def serve_flags(ckpt: str, **extra: Any) -> dict[str, Any]:
    """``serve --model DIR``: heads, layers, softmax scale (YaRN mscale) and kv_b_proj from the checkpoint."""
    return {"model": ckpt, "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS,
            "workspace_tokens": 32,  # under the longest context (72): the service loops over context chunks
            "backend": "reference", **extra}


class Setup:
    def __init__(self, root: str) -> None:
        self.model = make_model()
        self.bf16_dir = os.path.join(root, "bf16")
        self.model.save_pretrained(self.bf16_dir, max_shard_size="400KB")
        with open(os.path.join(self.bf16_dir, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        assert len({weight_map[kv_b_key(i)] for i in range(LAYERS)}) > 1  # the layers' kv_b_proj in several shards
        self.fp8_dir = os.path.join(root, "fp8")
        deq = to_fp8_checkpoint(self.bf16_dir, self.fp8_dir)
        self.fp8_model = make_model()  # the same model with the dequantized kv_b_proj
        for i, w in deq.items():
            self.fp8_model.model.layers[i].self_attn.kv_b_proj.weight.data = w
        g = torch.Generator().manual_seed(7)
        self.prompts = torch.randint(0, 256, (2, PROMPT), generator=g)
        self.reference = {id(m): capture(m, lambda m=m: m(input_ids=self.prompts)) for m in
                          (self.model, self.fp8_model)}


SERVERS = {
    "bf16": ("bf16", {}),
    "fp8": ("bf16", {"cache_dtype": "fp8"}),
    "fp8_ds_mla": ("bf16", {"cache_dtype": "fp8_ds_mla"}),
    "fp8_checkpoint": ("fp8", {}),
    "shard0": ("bf16", {"num_shards": 2, "shard_index": 0}),  # tensor parallel: one head each
    "shard1": ("bf16", {"num_shards": 2, "shard_index": 1}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(str(tmp_path_factory.mktemp("hf")))


@pytest.fixture(scope="module")
def servers(setup: Setup) -> Iterator[dict[str, ServerProcess]]:
    dirs = {"bf16": setup.bf16_dir, "fp8": setup.fp8_dir}
    procs = {name: ServerProcess(serve_flags(dirs[ck], **extra)) for name, (ck, extra) in SERVERS.items()}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


def staggered(runner: DeepseekV3ChunkedPrefill, prompts: torch.Tensor,
              between: Any = None) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Prompt 1 joins one chunk after prompt 0 (continuous batching): steps [0:c0], [0:c1, 1:c0],
    …, [1:c_last]; every step one batch, one PrefillContext per layer with both sequences when
    both run (one of them, in the second step, with no context). Returns the logits [2, T, vocab]
    and each layer's attention output [2, T, hidden], assembled by position."""
    n = PROMPT // CHUNK
    a, b = runner.new_sequences(2)
    logits = torch.zeros((2, PROMPT, runner.model.config.vocab_size))
    attn = [torch.zeros((2, PROMPT, runner.model.config.hidden_size)) for _ in range(LAYERS)]
    for step in range(n + 1):
        rows = [r for r, c in ((0, step), (1, step - 1)) if 0 <= c < n]
        chunks = [step if r == 0 else step - 1 for r in rows]
        ids = torch.stack([prompts[r, c * CHUNK:(c + 1) * CHUNK] for r, c in zip(rows, chunks, strict=True)])
        seqs = [(a, b)[r] for r in rows]
        outs, lg = capture(runner.model, lambda ids=ids, seqs=seqs: runner.prefill_chunk(ids, seqs))
        for k, (r, c) in enumerate(zip(rows, chunks, strict=True)):
            span = slice(c * CHUNK, (c + 1) * CHUNK)
            logits[r, span] = lg[k].float()
            for i in range(LAYERS):
                attn[i][r, span] = outs[i][0][k]
        if between is not None:
            between(step)
    assert a.length == b.length == PROMPT
    runner.release([a, b])
    return logits, attn


def errors(setup: Setup, model: Any, logits: torch.Tensor, attn: list[torch.Tensor]) -> dict[str, float]:
    ref_attn, ref_out = setup.reference[id(model)]
    err = {f"attention[{i}]": rel(attn[i], ref_attn[i][0]) for i in range(LAYERS)}
    err["logits"] = rel(logits, ref_out.logits)
    return err


def within(err: dict[str, float], tol: dict[str, float]) -> bool:
    return all(v <= tol["logits" if k == "logits" else "attention"] for k, v in err.items())


@pytest.mark.parametrize("name,tol,write_with_prefill", [
    ("bf16", BF16_TOL, True),
    ("bf16", BF16_TOL, False),
    ("fp8", FP8_TOL, True),
    ("fp8_ds_mla", FP8_TOL, True),
    ("fp8_checkpoint", BF16_TOL, True),
    ("sharded", BF16_TOL, True),
])
def test_chunked_prefill_matches_the_monolithic_forward(setup: Setup, servers: dict[str, ServerProcess],
                                                        name: str, tol: dict[str, float],
                                                        write_with_prefill: bool) -> None:
    """Every layer's attention output and the logits of both prompts, chunked through the service
    (bf16 / fp8 / fp8_ds_mla cache; bf16 or fp8 block-scaled kv_b_proj in the checkpoint), within
    ``tol`` of transformers' forward of the whole prompts."""
    model = setup.fp8_model if name == "fp8_checkpoint" else setup.model
    if name == "sharded":  # two workers of one head each, as two tensor-parallel ranks would run them
        client: Any = ShardedPrefillClient([servers["shard1"].target, servers["shard0"].target], timeout=60, retries=0)
    else:
        client = PrefillContextClient(servers[name].target, timeout=60, retries=0)
    with client:
        runner = DeepseekV3ChunkedPrefill(model, client, write_with_prefill=write_with_prefill)
        logits, attn = staggered(runner, setup.prompts)
        info = client.server_info()
        info = info[0] if isinstance(info, list) else info
    assert runner.calls == LAYERS * (PROMPT // CHUNK + 1)
    assert runner.allocator.num_free == NUM_BLOCKS
    assert info.kv_b_proj_dtype == ("fp8" if name == "fp8_checkpoint" else "bf16")
    err = errors(setup, model, logits, attn)
    assert within(err, tol), f"{name}: {err} (limits {tol})"


def test_the_context_part_is_far_above_the_tolerances(setup: Setup) -> None:
    """The control: chunks attending only to themselves (transformers' forward of each chunk
    alone, at its positions) miss the limits by far, so the comparisons above can fail."""
    def chunk_alone() -> torch.Tensor:
        parts = [setup.model(input_ids=setup.prompts[:, s:s + CHUNK],
                             position_ids=torch.arange(s, s + CHUNK).expand(2, -1)).logits
                 for s in range(0, PROMPT, CHUNK)]
        return torch.cat(parts, dim=1)

    outs, logits = capture(setup.model, chunk_alone)
    attn = [torch.cat(o, dim=1) for o in outs]
    err = errors(setup, setup.model, logits, attn)
    assert min(err.values()) > 10 * BF16_TOL["logits"], err


def test_a_restarted_server_is_rewritten_and_the_prefill_goes_on(setup: Setup,
                                                                  servers: dict[str, ServerProcess]) -> None:
    """The server restarts between two chunks (its cache is gone, a new instance id): the next
    call fails FAILED_PRECONDITION, the runner writes every kept latent again and retries, and
    the result still matches the monolithic forward."""
    proc = servers["bf16"]
    restarted: list[int] = []

    def restart(step: int) -> None:
        if step == 1:
            proc.terminate(timeout=30)
            proc.kill()
            servers["bf16"] = ServerProcess(proc._flags, port=proc.port, metrics_port=proc.metrics_port)
            servers["bf16"].wait_ready()
            restarted.append(step)

    with PrefillContextClient(proc.target, timeout=60, retries=5, backoff_max=1.0) as client:
        runner = DeepseekV3ChunkedPrefill(setup.model, client)
        first = client.instance_id
        logits, attn = staggered(runner, setup.prompts, between=restart)
        assert restarted == [1] and client.instance_id != first and runner.restarts == 1
    err = errors(setup, setup.model, logits, attn)
    assert within(err, BF16_TOL), err


def test_without_kept_latents_a_restart_surfaces(setup: Setup, servers: dict[str, ServerProcess]) -> None:
    with PrefillContextClient(servers["bf16"].target, timeout=60, retries=0) as client:
        runner = DeepseekV3ChunkedPrefill(setup.model, client, keep_latents=False)
        seqs = runner.new_sequences(1)
        runner.prefill_chunk(setup.prompts[:1, :CHUNK], seqs)
        client.reset_instance("another-instance")
        with pytest.raises(ServerRestartedError):
            runner.prefill_chunk(setup.prompts[:1, CHUNK:2 * CHUNK], seqs)
        runner.release(seqs)


def test_a_server_that_is_not_the_model_is_refused(setup: Setup, servers: dict[str, ServerProcess]) -> None:
    other = make_model()
    for a in (layer.self_attn for layer in other.model.layers):
        a.scaling = a.scaling * 0.5
    with PrefillContextClient(servers["bf16"].target, timeout=60, retries=0) as client:
        with pytest.raises(IncompatibleServerError, match="softmax_scale"):
            DeepseekV3ChunkedPrefill(other, client)
        cfg = make_config()
        cfg.num_hidden_layers = LAYERS + 1
        with pytest.raises(IncompatibleServerError, match="layers"):
            DeepseekV3ChunkedPrefill(DeepseekV3ForCausalLM(cfg), client)


def test_importing_the_integration_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, ctxprefill_client.integrations.transformers_deepseek; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], env=env_with_sources(), capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_each_chunk_reports_its_time_split(setup: Setup, servers: dict[str, ServerProcess]) -> None:
    """prefill() of both prompts: one ChunkTiming per chunk, its local and remote parts summing to
    its total; the remote part (the client's wall time of the calls) holds the server's time,
    which holds its compute; the context grows by a chunk per sequence each time."""
    with PrefillContextClient(servers["bf16"].target, timeout=60, retries=0) as client:
        runner = DeepseekV3ChunkedPrefill(setup.model, client)
        logits, seqs = runner.prefill(setup.prompts, chunk_size=CHUNK)
        runner.release(seqs)
    assert rel(logits, setup.reference[id(setup.model)][1].logits) <= BF16_TOL["logits"]
    n = PROMPT // CHUNK
    assert [t.index for t in runner.timings] == list(range(n))
    assert [t.context_tokens for t in runner.timings] == [2 * i * CHUNK for i in range(n)]
    for t in runner.timings:
        assert t.tokens == 2 * CHUNK and t.calls == LAYERS
        assert t.local_s + t.remote_s == pytest.approx(t.total_s, rel=1e-9, abs=1e-12)
        assert t.local_s > 0 and t.remote_s >= t.server_total_s >= t.server_compute_s >= 0
        assert t.server_total_s > 0


def test_the_cuda_transport_is_checked(setup: Setup, servers: dict[str, ServerProcess]) -> None:
    """transport="cuda" needs a server offering CUDA regions, then a model on a CUDA device."""
    with PrefillContextClient(servers["bf16"].target, timeout=60, retries=0) as client:
        with pytest.raises(ValueError, match="transport must be one of inline, cuda"):
            DeepseekV3ChunkedPrefill(setup.model, client, transport="system")
        with pytest.raises(IncompatibleServerError, match="shared_memory_kinds: .*--shared-memory cuda"):
            DeepseekV3ChunkedPrefill(setup.model, client, transport="cuda")

        class OffersCuda:  # the same server, as one with --shared-memory cuda would answer
            def server_info(self, timeout: float | None = None) -> Any:
                return dataclasses.replace(client.server_info(timeout=timeout), shared_memory_kinds=("cuda",))

            def register_cuda_shared_memory(self, region: Any) -> None:
                raise AssertionError("nothing is registered for a model on the CPU")

        with pytest.raises(ValueError, match="the model is on cpu"):
            DeepseekV3ChunkedPrefill(setup.model, OffersCuda(), transport="cuda")


def test_the_merge_on_torch_tensors_is_merge_partials() -> None:
    """merge_partials_torch (the integration's merge, on the model's device) against the numpy
    merge_partials, with rows empty on one side (-inf, +inf: the other side's out is garbage)
    and on both."""
    g = torch.Generator().manual_seed(3)
    T, H, V = 12, 3, 8
    out_a, out_b = torch.randn((T, H, V), generator=g), torch.randn((T, H, V), generator=g)
    lse_a, lse_b = torch.randn((H, T), generator=g) * 4, torch.randn((H, T), generator=g) * 4
    lse_b[:, :3] = float("-inf")
    out_b[:3] = float("nan")  # the rows whose lse_b is -inf
    lse_a[1, 5] = float("inf")
    lse_a[0, 7] = lse_b[0, 7] = float("-inf")
    got = merge_partials_torch(out_a.to(torch.bfloat16), lse_a, out_b.to(torch.bfloat16), lse_b)
    want, _ = merge_partials(out_a.to(torch.bfloat16).float().numpy(), lse_a.numpy(),
                             out_b.to(torch.bfloat16).float().numpy(), lse_b.numpy())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[7, 0], torch.zeros(V))
    with pytest.raises(ValueError, match="lse"):
        merge_partials_torch(out_a, lse_a.T, out_b, lse_b)


def test_bench_model_prefill_runs_on_the_cpu(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/bench_model_prefill.py end to end with tiny shapes (inline: CUDA IPC needs a GPU): a
    row per chunk whose local and remote parts sum to its total, errors within the limits and
    the control far above them; make_tables makes its section of bench/results/README.md."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_model_prefill",
                                                  os.path.join(root, "bench", "bench_model_prefill.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench_model_prefill.json"
    rc = mod.main(["--device", "cpu", "--hidden", "64", "--prompt", "96", "--chunk", "32", "--layers", "2",
                   "--heads", "2", "--vocab", "256", "--intermediate", "128", "--q-lora-rank", "96",
                   "--block-size", "16", "--backend", "reference", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(out.read_text())
    assert d["meta"]["kind"] == "model_prefill" and d["meta"]["model"]["shards"] >= 4
    assert list(d["transports"]) == ["inline"] and d["within_tolerance"] == {"inline": True}
    r = d["transports"]["inline"]
    assert [row["context_tokens"] for row in r["rows"]] == [0, 32, 64]
    for row in r["rows"]:
        assert row["calls"] == 2
        assert row["local_ms"] + row["remote_ms"] == pytest.approx(row["total_ms"])
        assert row["remote_ms"] >= row["server_total_ms"] >= row["server_compute_ms"] >= 0
    assert r["totals"]["remote_ms"] == pytest.approx(sum(row["remote_ms"] for row in r["rows"]))
    assert min(d["control_errors"].values()) > 10 * max(r["errors"].values())

    import make_tables  # bench/ is on the path (conftest.py)

    (b,) = [b for b in make_tables.BENCHMARKS if b.step == "bench_model_prefill"]
    results = tmp_path / "results"
    shutil.copytree(make_tables.RESULTS, results)
    shutil.copy(out, results / "bench_model_prefill.json")  # this run's JSON over the recorded one
    assert "bench_model_prefill" in make_tables.files()
    readme = make_tables.results_readme(str(results))
    assert f"## {b.title}" in readme and "| inline | **all** |" in readme


def test_block_allocator() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError):
        alloc.allocate(2)
    alloc.free([1])
    assert alloc.allocate(2) == [3, 1]
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([4])
