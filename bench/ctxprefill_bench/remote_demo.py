"""``ctxprefill demo --target host:port``: the demo against a running server.

Through the client package: GetServerInfo; random context written into randomly
chosen blocks (WriteCache: this overwrites whatever those blocks held — a demo, not
for a server in use); one multi-sequence PrefillContext with a small workspace so
that there are several chunks; then a check against an unchunked float64 computation
made here, from the slot bytes read back with ReadCache (decoded with
``ops.slot_format.decode_slots``) and the server's weights. The weights are known
here when the server runs random weights of the same ``--seed`` and
``--kv-b-proj-dtype`` as given to this command, or when ``--weights`` names a file
readable here; otherwise the float64 check is skipped (reported as n/a).
"""

from __future__ import annotations

import math
import os
import time
import types

import numpy as np
import torch

from ctxprefill.checkpoint import load_model_kv_b_proj
from ctxprefill.config import CacheConfig, ModelShape
from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.errors import ConfigError
from ctxprefill.ops.fp8 import FP8
from ctxprefill.settings import ServeSettings, layer_prefix
from ctxprefill.weights import load_kv_b_proj, prepare, random_kv_b_proj

from .demo import DEMO_CONTEXTS, DEMO_QUERIES
from .reference64 import prefill_context_float64
from .workload import FLOAT64_TOLERANCE, relative_error


def _local_weights(info, s: ServeSettings, shape: ModelShape, layer: int):
    """The server's kv_b_proj weights of model layer ``layer`` rebuilt here, or (None, why not)."""
    if info.weights_source.startswith("random("):
        if info.weights_source != f"random(seed={s.seed})":
            return None, f"server runs {info.weights_source}, this command has --seed {s.seed}"
        if info.kv_b_proj_dtype != s.kv_b_proj_dtype:
            return None, (f"server's random weights are {info.kv_b_proj_dtype}, "
                          f"this command has --kv-b-proj-dtype {s.kv_b_proj_dtype}")
        t = random_kv_b_proj(shape, s.kv_b_proj_dtype, s.seed + layer)  # as settings.layer_weights
        return prepare(s.kv_b_proj_dtype, t["kv_b_proj.weight"], t.get("kv_b_proj.weight_scale_inv")), ""
    path = s.model or s.weights or info.weights_source
    if path and os.path.isdir(path):  # a checkpoint directory (serve --model): this shard's heads of that layer
        try:
            (w,) = load_model_kv_b_proj(path, layer, 1, info.total_heads or info.num_heads, info.shard_index,
                                        max(info.num_shards, 1))
            return w, ""
        except ConfigError as e:
            return None, str(e)
    if path and os.path.isfile(path):
        try:  # a server of several layers: the prefix must say where each layer's weight is
            return load_kv_b_proj(path, shape, layer_prefix(s.weights_prefix, layer, info.num_layers)), ""
        except ConfigError as e:
            return None, str(e)
    return None, f"server's weights {info.weights_source!r} are not readable here"


def _fit(contexts: list[int], block_size: int, num_blocks: int) -> list[int]:
    """Scale the demo's context lengths down until their blocks fit the server's cache."""
    need = lambda cs: sum(math.ceil(n / block_size) for n in cs)  # noqa: E731
    f = 1.0
    while need(cs := [int(n * f) for n in contexts]) > num_blocks and f > 1e-3:
        f *= 0.8
    return cs


def run_remote_demo(target: str, s: ServeSettings, contexts=DEMO_CONTEXTS, queries=DEMO_QUERIES,
                    workspace_tokens: int | None = None) -> int:
    from ctxprefill.service.security import load_token
    from ctxprefill_client import FP8_E4M3, PrefillContextClient, RawTensor, slot_mapping

    # a server with credentials: its token (--auth-token-file / CTXPREFILL_AUTH_TOKEN) and, for TLS, the
    # certificate to trust (--tls-cert: the server's own, or the CA that signed it)
    with PrefillContextClient(target, timeout=120.0, token=load_token(s.auth_token_file),
                              root_certificates=s.tls_cert) as client:
        info = client.server_info()
        layer = info.first_layer  # of a server of several layers, the first
        bs, nb, H = info.block_size, info.num_blocks, info.num_heads
        L, R = info.kv_lora_rank, info.qk_rope_head_dim
        why = "" if info.fused_kernels_active else f" ({info.fused_kernels_reason})"
        print(
            f"ctxprefill demo --target {target}: instance={info.instance_id[:12]} device={info.device} "
            f"backend={info.attention_backend} (supports out: {info.attention_backend_supports_out}) "
            f"fused kernels={info.fused_kernels_active}{why} unpacked keys={info.unpacked_keys}"
        )
        print(
            f"heads={H} cache={info.cache_dtype} k_scale={info.k_scale} kv_b_proj={info.kv_b_proj_dtype} "
            f"prefill={info.prefill_dtype} block={bs} blocks={nb} weights={info.weights_source} "
            f"versions={info.versions}" + (f" layer={layer} of {list(info.layers)}" if info.num_layers > 1 else "")
        )
        contexts = _fit(list(contexts), bs, nb)
        g = torch.Generator().manual_seed(s.seed + 1)
        need = [math.ceil(n / bs) for n in contexts]
        perm = torch.randperm(nb, generator=g)[: sum(need)].tolist()
        tables, at = [], 0
        for k in need:
            tables.append(perm[at : at + k])
            at += k
        slots = np.concatenate(
            [slot_mapping(bt, 0, n, bs) for n, bt in zip(contexts, tables) if n] or [np.zeros(0, dtype=np.int64)]
        )
        kv_c = torch.randn((len(slots), L), generator=g).numpy()
        k_pe = torch.randn((len(slots), R), generator=g).numpy()
        written = client.write_cache(slots, kv_c, k_pe, layer=layer)

        q32 = torch.randn((sum(queries), H, info.qk_head_dim), generator=g)
        if info.prefill_dtype == "fp8":
            q_t = q32.clamp(-448, 448).to(FP8)
            q_wire = RawTensor(FP8_E4M3, q_t.view(torch.uint8).numpy())
        else:
            q_t = q32.to(torch.bfloat16)
            q_wire = q_t.view(torch.int16).numpy().view(np.uint16)
        seqs = [(qn, n, bt) for qn, n, bt in zip(queries, contexts, tables)]
        W = workspace_tokens or min(info.workspace_tokens, max(512, bs))
        t = time.perf_counter()
        res = client.prefill_context(q_wire, seqs, workspace_tokens=W, request_id="remote-demo", layer=layer)
        ms = (time.perf_counter() - t) * 1e3

        # every block used, read back: the reference sees exactly the bytes the server holds
        blocks = [b for bt in tables for b in bt]
        raw = client.read_cache(
            slot_mapping(blocks, 0, len(blocks) * bs, bs), layer=layer
        ) if blocks else np.zeros((0, info.bytes_per_slot), dtype=np.uint8)

    st = res.stats
    print(f"contexts={contexts} queries={list(queries)} workspace_tokens={W} slots written={written}")
    print(f"{'path':8} {'chunks':>6} {'launches per stage':42} {'rel err out':>11} {'max |Δlse|':>10} {'ms':>8}")
    lau = " ".join(f"{k}={v}" for k, v in sorted(st["kernel_launches"].items()))

    shape = ModelShape(heads=H, softmax_scale=info.softmax_scale)
    weights, why = _local_weights(info, s, shape, layer)
    if weights is None:
        print(f"{st['path']:8} {st['num_chunks']:6d} {lau:42} {'n/a':>11} {'n/a':>10} {ms:8.2f}")
        print(f"float64 check skipped: {why}")
        return 0
    # a compact cache holding just the blocks read back, and block tables into it
    compact = types.SimpleNamespace(
        config=types.SimpleNamespace(shape=shape, cache=CacheConfig(info.cache_dtype, bs, max(len(blocks), 1),
                                                                    info.k_scale)),
        weights=weights,
        cache=types.SimpleNamespace(storage=torch.from_numpy(np.array(raw))),
    )
    where = {b: i for i, b in enumerate(blocks)}
    ref_seqs = [SequenceSpec(qn, n, [where[b] for b in bt]) for qn, n, bt in zip(queries, contexts, tables)]
    ref_out, ref_lse = prefill_context_float64(compact, q_t, ref_seqs)
    out = torch.from_numpy(np.array(res.output))
    lse = torch.from_numpy(np.array(res.lse))
    err = relative_error(out, ref_out)
    fin = torch.isfinite(ref_lse)
    dl = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if bool(fin.any()) else 0.0
    empty_ok = bool((lse[~fin] == float("-inf")).all()) and bool((out[~fin.t()] == 0).all())
    tol = FLOAT64_TOLERANCE[info.prefill_dtype]
    ok = err <= tol and dl <= tol and empty_ok
    print(f"{st['path']:8} {st['num_chunks']:6d} {lau:42} {err:11.2e} {dl:10.2e} {ms:8.2f}")
    print(f"error vs float64 within {tol}: {ok}" + ("" if empty_ok else " (rows without context are not 0 / -inf)"))
    return 0 if ok else 1
