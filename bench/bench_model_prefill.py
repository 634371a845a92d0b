"""Benchmark: a real model's chunked prefill with ctxprefill computing every layer's context
attention, through CUDA IPC (docs/INTEGRATION.md, docs/TRANSPORT.md).

A random transformers DeepSeek-V3 model (the real architecture: q LoRA, the kv_a latent and
its norm, kv_b_proj, YaRN RoPE; every layer dense) is saved as a sharded checkpoint, served by
``ctxprefill serve --model DIR --shared-memory cuda`` (a subprocess on loopback), and one
prompt is prefilled chunk by chunk through
``ctxprefill_client.integrations.transformers_deepseek.DeepseekV3ChunkedPrefill``: per layer
and chunk, q and the chunk's latents go to the server as references into one registered CUDA
region, output and LSE come back into it, and the merge with the chunk's own causal attention
runs on the GPU. The same with ``transport="inline"`` (bytes in the messages) for comparison.

Per chunk: the local work (the model's own: projections, causal attention, merges, MLP; the
device synchronized), the client-observed time of the ctxprefill calls (summed over the
layers), and the server's own total and compute time (Stats). Every layer's attention output
and the logits are compared with transformers' forward of the whole prompt: ``‖a − b‖ / ‖b‖``.
Two controls beside them: transformers' forward of every chunk alone (no context) shows what a
missing context part scores; transformers' own chunked prefill (its ``DynamicCache``, the same
chunks) shows how far chunking alone moves a bf16 model's result. ``--dtype float32`` runs the
same bf16 weights in float32 (the server's cache stays as configured), which takes the model's
own rounding out of the comparison.
Each transport's prefill runs ``--repeats`` times; the last is reported (the first warms up
the server's kernels and the client's buffers), the warm-up's totals beside it. Exit code 1
when an error is over its tolerance.

  PYTHONPATH=server:client:bench python3 bench/bench_model_prefill.py --out bench/results/bench_model_prefill.json
  PYTHONPATH=server:client:bench python3 bench/bench_model_prefill.py --device cpu --hidden 256 --prompt 256 \\
      --chunk 64 --layers 2 --heads 2 --vocab 1024 --intermediate 512 --q-lora-rank 256 --block-size 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("client", "server", "bench"):
    if os.path.join(ROOT, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, _sub))

import torch  # noqa: E402

from ctxprefill_bench import deepseek_model  # noqa: E402
from ctxprefill_bench.deepseek_model import L, P, R, V, rel  # noqa: E402
from ctxprefill_bench.run_info import commit, utc_now  # noqa: E402
from progress import log  # noqa: E402
from server_process import ServerProcess  # noqa: E402

KIND = "model_prefill"


def make_model(ns: argparse.Namespace, dev: torch.device) -> Any:
    """The random bf16 model of ``ns`` on ``dev`` (``ctxprefill_bench.deepseek_model``, as the tests build it)."""
    config = deepseek_model.make_config(layers=ns.layers, heads=ns.heads, hidden=ns.hidden, q_lora_rank=ns.q_lora_rank,
                                        intermediate=ns.intermediate, vocab=ns.vocab, original_max_positions=4096)
    return deepseek_model.make_model(config, seed=ns.seed, device=dev)


def capture(model: Any, run: Callable[[], Any]) -> tuple[list[torch.Tensor], Any]:
    """``run()`` with every layer's self_attn output recorded: (per layer: the output of the one
    call, ``run()``'s result)."""
    outs, result = deepseek_model.capture(model, run)
    assert all(len(o) == 1 for o in outs)
    return [o[0] for o in outs], result


def chunked_errors(ns: argparse.Namespace, model: Any, prompt: torch.Tensor, ref_attn: list[torch.Tensor],
                   ref_logits: torch.Tensor, own_cache: bool) -> dict[str, float]:
    """The errors of transformers' forward chunk by chunk at the chunks' positions: without
    ``own_cache`` every chunk alone (no context: what a missing context part scores, far above
    the tolerances); with it transformers' own chunked prefill (its ``DynamicCache``: how far
    chunking alone moves the result at the model's precision, the yardstick for ctxprefill's)."""
    from transformers import DynamicCache

    cache = {"past_key_values": DynamicCache(config=model.config), "use_cache": True} if own_cache else {}
    attn: list[list[torch.Tensor]] = [[] for _ in range(ns.layers)]
    logits = []
    for i in range(0, ns.prompt, ns.chunk):
        ids = prompt[:, i:i + ns.chunk]
        pos = torch.arange(i, i + ids.shape[1], device=prompt.device)[None]
        outs, out = capture(model, lambda ids=ids, pos=pos: model(input_ids=ids, position_ids=pos, **cache))
        logits.append(out.logits)
        for k in range(ns.layers):
            attn[k].append(outs[k])
    err = {f"attention[{k}]": rel(torch.cat(attn[k], dim=1), ref_attn[k]) for k in range(ns.layers)}
    err["logits"] = rel(torch.cat(logits, dim=1), ref_logits)
    return err


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def chunk_rows(timings: list[Any], first_index: int) -> list[dict[str, Any]]:
    """One JSON row per chunk (``ChunkTiming`` of the integration), times in ms."""
    return [{"chunk": t.index - first_index, "new_tokens": t.tokens, "context_tokens": t.context_tokens,
             "calls": t.calls, "total_ms": t.total_s * 1e3, "local_ms": t.local_s * 1e3, "remote_ms": t.remote_s * 1e3,
             "server_total_ms": t.server_total_s * 1e3, "server_compute_ms": t.server_compute_s * 1e3}
            for t in timings]


def totals(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("total_ms", "local_ms", "remote_ms", "server_total_ms", "server_compute_ms")
    out = {k: sum(r[k] for r in rows) for k in keys}
    out["calls"] = sum(r["calls"] for r in rows)
    return out


def run_transport(ns: argparse.Namespace, model: Any, client: Any, transport: str, prompt: torch.Tensor,
                  ref_attn: list[torch.Tensor], ref_logits: torch.Tensor, dev: torch.device) -> dict[str, Any]:
    from ctxprefill_client.integrations.transformers_deepseek import DeepseekV3ChunkedPrefill

    result: dict[str, Any] = {}
    with DeepseekV3ChunkedPrefill(model, client, transport=transport, max_chunk_tokens=ns.chunk,
                                  keep_latents=False, timeout=ns.timeout) as runner:
        for rep in range(ns.repeats):
            first = len(runner.timings)
            seqs = runner.new_sequences(1)
            attn: list[list[torch.Tensor]] = [[] for _ in range(ns.layers)]
            logits = []
            _sync(dev)
            t0 = time.perf_counter()
            for i in range(0, ns.prompt, ns.chunk):
                ids = prompt[:, i:i + ns.chunk]
                outs, lg = capture(model, lambda ids=ids: runner.prefill_chunk(ids, seqs))
                logits.append(lg)
                for k in range(ns.layers):
                    attn[k].append(outs[k])
            _sync(dev)
            wall = time.perf_counter() - t0
            runner.release(seqs)
            rows = chunk_rows(runner.timings[first:], first)
            tot = totals(rows)
            log(f"{transport} run {rep + 1}/{ns.repeats}: {wall * 1e3:.1f} ms for {len(rows)} chunks (local "
                f"{tot['local_ms']:.1f}, remote {tot['remote_ms']:.1f}, server compute {tot['server_compute_ms']:.1f})")
            if rep + 1 < ns.repeats:
                result.setdefault("warmup_totals", []).append(tot)
                continue
            errors = {f"attention[{k}]": rel(torch.cat(attn[k], dim=1), ref_attn[k]) for k in range(ns.layers)}
            errors["logits"] = rel(torch.cat(logits, dim=1), ref_logits)
            result.update(rows=rows, totals=tot, prefill_ms=wall * 1e3, errors=errors,
                          max_attention_error=max(v for k, v in errors.items() if k != "logits"))
            log(f"{transport}: errors against the monolithic forward " +
                ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:N")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16, help="attention heads (DeepSeek-V3: 128)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--q-lora-rank", type=int, default=1536)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the model's compute dtype (its weights are bf16 either way; the cache is the server's)")
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--workspace-tokens", type=int, default=None, help="the server's (default: its own)")
    p.add_argument("--backend", default="auto", help="the server's attention backend")
    p.add_argument("--transports", nargs="+", choices=["cuda", "inline"], default=None,
                   help="default: cuda inline on a CUDA device, inline on a CPU")
    p.add_argument("--repeats", type=int, default=2, help="prefills per transport; the last is reported")
    p.add_argument("--shard-size", default=None, help="save_pretrained's max_shard_size (default: 4 shards or more)")
    p.add_argument("--attention-tol", type=float, default=2e-2, help="largest relative error of a layer's attention")
    p.add_argument("--logits-tol", type=float, default=4e-2, help="largest relative error of the logits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each RPC, seconds")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds the server may take to start")
    p.add_argument("--out", default=None, help="write JSON results here")
    ns = p.parse_args(argv)
    if ns.prompt < 1 or ns.chunk < 1 or ns.repeats < 1:
        p.error("--prompt, --chunk and --repeats must be >= 1")

    import transformers

    from ctxprefill.settings import resolve_device
    from ctxprefill_client import PrefillContextClient

    dev = resolve_device(ns.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    transports = ns.transports or (["cuda", "inline"] if dev.type == "cuda" else ["inline"])
    if "cuda" in transports and dev.type != "cuda":
        p.error("--transports cuda needs a CUDA device")
    log(f"device {dev} ({gpu or 'cpu'}); torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{ns.layers} layers x {ns.heads} heads, hidden {ns.hidden}; {ns.prompt} tokens in chunks of {ns.chunk}")

    model = make_model(ns, dev)
    params = sum(x.numel() for x in model.parameters())
    g = torch.Generator(device=dev).manual_seed(ns.seed + 7)
    prompt = torch.randint(0, ns.vocab, (1, ns.prompt), generator=g, device=dev)

    results: dict[str, Any] = {}
    info = None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "model")
        shard = ns.shard_size or max(1, params * 2 // 4 // 1024) * 1024  # bytes: >= 4 shards
        model.save_pretrained(ckpt, max_shard_size=shard)
        shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        if ns.dtype == "float32":  # the checkpoint keeps bf16 weights; the model computes with them widened
            model = model.float()
        log(f"model: {params / 1e6:.1f} M parameters, saved as {len(shards)} safetensors shards")
        blocks = -(-ns.prompt // ns.block_size) + 4
        flags: dict[str, object] = {"model": ckpt, "device": str(dev), "block_size": ns.block_size,
                                    "num_blocks": blocks, "backend": ns.backend, "grace_seconds": 5,
                                    "shared_memory": "cuda" if "cuda" in transports else "off"}
        if ns.workspace_tokens:
            flags["workspace_tokens"] = ns.workspace_tokens
        server = ServerProcess("model_prefill", flags, tmp)
        t_server = time.monotonic()
        log("starting the server: " + server.cmd)
        try:
            # the references while the server starts
            _sync(dev)
            t = time.perf_counter()
            ref_attn, ref_out = capture(model, lambda: model(input_ids=prompt))
            _sync(dev)
            ref_ms = (time.perf_counter() - t) * 1e3
            ref_logits = ref_out.logits
            log(f"the monolithic forward ({model.config._attn_implementation} attention): {ref_ms:.1f} ms")
            control = chunked_errors(ns, model, prompt, ref_attn, ref_logits, own_cache=False)
            log("control, every chunk alone (no context): " + ", ".join(f"{k} {v:.2e}" for k, v in control.items()))
            own = chunked_errors(ns, model, prompt, ref_attn, ref_logits, own_cache=True)
            log("transformers' own chunked prefill: " + ", ".join(f"{k} {v:.2e}" for k, v in own.items()))
            server.wait_ready(ns.ready_timeout)
            ready_s = time.monotonic() - t_server
            with PrefillContextClient(server.target, timeout=ns.timeout, retries=0,
                                      max_message_bytes=1 << 30) as client:
                info = client.server_info()
                log(f"server ready {ready_s:.1f} s after its start: {info.device}, backend "
                    f"{info.attention_backend}, fused {info.fused_kernels_active}, workspace {info.workspace_tokens}, "
                    f"shared memory {', '.join(info.shared_memory_kinds) or 'off'}")
                for tr in transports:
                    results[tr] = run_transport(ns, model, client, tr, prompt, ref_attn, ref_logits, dev)
        finally:
            server.stop(timeout=15)
            server_log = server.tail(40)

    ok = {tr: r["max_attention_error"] <= ns.attention_tol and r["errors"]["logits"] <= ns.logits_tol
          for tr, r in results.items()}
    print()
    print(f"{'transport':>9} {'chunk':>5} {'context':>7} {'local ms':>9} {'remote ms':>9} {'server ms':>9} "
          f"{'compute ms':>10}")
    for tr, r in results.items():
        for row in [*r["rows"], {"chunk": "all", "context_tokens": "", **r["totals"]}]:
            print(f"{tr:>9} {row['chunk']:>5} {row['context_tokens']:>7} {row['local_ms']:9.2f} "
                  f"{row['remote_ms']:9.2f} {row['server_total_ms']:9.2f} {row['server_compute_ms']:10.2f}")
        print(f"{tr:>9} errors: attention <= {r['max_attention_error']:.2e}, logits {r['errors']['logits']:.2e} "
              f"({'within' if ok[tr] else 'OVER'} {ns.attention_tol:g} / {ns.logits_tol:g})")

    if ns.out:
        cfg = model.config
        meta = {
            "kind": KIND, "date": utc_now(), "commit": commit(), "gpu": gpu, "device": str(dev),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "model": {"layers": ns.layers, "heads": ns.heads, "hidden": ns.hidden, "q_lora_rank": ns.q_lora_rank,
                      "kv_lora_rank": L, "qk_nope_head_dim": P, "qk_rope_head_dim": R, "v_head_dim": V,
                      "intermediate": ns.intermediate, "vocab": ns.vocab, "dtype": ns.dtype,
                      "rope_parameters": cfg.rope_parameters, "softmax_scale": float(
                          model.model.layers[0].self_attn.scaling),
                      "parameters": params, "shards": len(shards),
                      "reference_attention": cfg._attn_implementation},
            "prompt_tokens": ns.prompt, "chunk_tokens": ns.chunk, "chunks": math.ceil(ns.prompt / ns.chunk),
            "server": None if info is None else {
                "cmd": server.cmd, "ready_s": ready_s, "attention_backend": info.attention_backend,
                "fused_kernels_active": info.fused_kernels_active, "workspace_tokens": info.workspace_tokens,
                "cache_dtype": info.cache_dtype, "prefill_dtype": info.prefill_dtype,
                "block_size": info.block_size, "num_blocks": info.num_blocks,
                "shared_memory_kinds": list(info.shared_memory_kinds)},
            "args": vars(ns),
        }
        doc = {"meta": meta, "reference_forward_ms": ref_ms, "tolerances": {"attention": ns.attention_tol,
                                                                          "logits": ns.logits_tol},
               "transports": results, "within_tolerance": ok, "control_errors": control,
               "transformers_chunked_errors": own,
               "server_log_tail": server_log}
        with open(ns.out, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"wrote {ns.out}")
    return 0 if ok and all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
