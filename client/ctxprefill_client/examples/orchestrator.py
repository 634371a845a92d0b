"""A disaggregated-prefill orchestrator in miniature (numpy only).

For a batch of sequences it computes full prefill attention the way an orchestrator
does with ctxprefill (CONTRACT §3, §7):

1. asks the server for its shapes (``server_info``);
2. writes random context latents (``c``, ``k_pe``) into random blocks of the
   server's cache (``write_cache``) and reads them back (``read_cache``) — the
   reference uses exactly what the cache holds, dequantized per its dtype;
3. gets the attention of the new tokens over their context from the server
   (``prefill_context``: output + natural-log LSE);
4. computes the new tokens' causal attention over themselves locally, in float64,
   from new-token keys and values it makes up;
5. merges the two partials by LSE (:func:`ctxprefill_client.merge_partials`);
6. checks the merged result against one full attention over context + new tokens,
   computed locally in float64, and exits non-zero if the error is over tolerance.

The context keys and values come from ``kv_b_proj`` applied to the cached latents, so
the example needs the same ``kv_b_proj`` weight as the server: start the server with
``--weights PATH`` (and ``--weights-prefix``) and give the example the same file.
Without one at hand, the example can write a random bf16 file first:

    python -m ctxprefill_client.examples.orchestrator --write-weights /tmp/w.safetensors --heads 16
    ctxprefill serve --weights /tmp/w.safetensors --heads 16 &
    python -m ctxprefill_client.examples.orchestrator --target localhost:50051 --weights /tmp/w.safetensors

With ``--shared-memory system`` (a server started with ``--shared-memory system|all`` on
the same host, or in the same IPC namespace: ``deploy/compose.shared-memory.yaml``), q,
the output and the LSE go through a POSIX shared-memory region instead of the messages.

On a server of several layers (``serve --layers N``), ``--layer I`` picks the layer and
``--weights-prefix`` may hold ``{layer}``, as the server's does.

It overwrites the blocks it picks: point it at a server no one else is using.
Tolerance: max |error| / max |reference| and max |LSE error| (natural log) both at
most 2e-2 for bf16 prefill, 1e-1 for fp8 prefill (k and v are quantized to e4m3
there); ``--rtol`` overrides. It also checks the bytes the cache stored for the
latents it wrote (CONTRACT §2). Exit status 0 when everything is within tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections.abc import Callable
from collections.abc import Sequence as _Seq
from typing import Any

import numpy as np

from ctxprefill_client import (
    BF16,
    FP8_E4M3,
    PrefillContextClient,
    PrefillResult,
    RawTensor,
    Sequence,
    SystemSharedMemoryRegion,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    float32_to_fp8_e4m3_bits,
    fp8_e4m3_bits_to_float32,
    merge_partials,
    slot_mapping,
)

# --------------------------------------------------------------------------- safetensors
# A minimal reader/writer of the safetensors format (8-byte little-endian header length,
# JSON header, raw little-endian data). safetensors.numpy cannot hold bf16 or fp8 (numpy
# has neither), so bf16 is read as uint16 bits and fp8 as uint8 bits. Nothing is unpickled.

_ST_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"),
    "F8_E4M3": np.dtype("u1"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
}


def read_safetensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """``{name: (safetensors dtype, array of raw storage)}``; bf16 as uint16 bits, fp8 as uint8."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dt = meta["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
        start, end = meta["data_offsets"]
        storage = _ST_DTYPES[dt]
        shape = tuple(meta["shape"])
        if end - start != math.prod(shape) * storage.itemsize:
            raise ValueError(f"{path}: tensor {name!r}: byte range does not match shape {list(shape)}")
        arr = np.frombuffer(blob, dtype=storage, count=math.prod(shape), offset=base + start).reshape(shape)
        out[name] = (dt, arr)
    return out


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write ``{name: (safetensors dtype, raw storage array)}`` (bf16 as uint16 bits)."""
    header: dict[str, Any] = {}
    chunks = []
    offset = 0
    for name, (dt, arr) in tensors.items():
        data = np.ascontiguousarray(arr, dtype=_ST_DTYPES[dt]).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for c in chunks:
            f.write(c)


def load_kv_b_proj(path: str, prefix: str = "") -> np.ndarray:
    """The dequantized ``kv_b_proj`` weight ``[H*(P+V), L]`` in float64 (CONTRACT §8 formats)."""
    tensors = read_safetensors(path)
    key = f"{prefix}kv_b_proj.weight"
    if key not in tensors:
        raise KeyError(f"{path}: no tensor {key!r} (have {sorted(tensors)})")
    dt, w = tensors[key]
    if dt == "BF16":
        return bf16_bits_to_float32(w).astype(np.float64)
    if dt in ("F32", "F16"):
        return w.astype(np.float64)
    if dt != "F8_E4M3":
        raise ValueError(f"{key}: unsupported dtype {dt}")
    wq = fp8_e4m3_bits_to_float32(w).astype(np.float64)
    if f"{prefix}kv_b_proj.weight_scale_inv" in tensors:
        _, s = tensors[f"{prefix}kv_b_proj.weight_scale_inv"]
        s = s.astype(np.float64)
        rows, cols = wq.shape
        full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
        scaled: np.ndarray = wq * full
        return scaled
    if f"{prefix}kv_b_proj.weight_scale" in tensors:
        _, s = tensors[f"{prefix}kv_b_proj.weight_scale"]
        return wq * float(np.asarray(s, dtype=np.float64).reshape(-1)[0])
    raise KeyError(f"{path}: fp8 {key} needs kv_b_proj.weight_scale_inv or kv_b_proj.weight_scale")


def make_random_weights(path: str, heads: int, *, kv_lora_rank: int = 512, nope: int = 128, v: int = 128,
                        seed: int = 0, prefix: str = "") -> None:
    """Write a random bf16 ``kv_b_proj.weight`` ``[heads*(nope+v), kv_lora_rank]``, std 1/sqrt(L)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((heads * (nope + v), kv_lora_rank)) / math.sqrt(kv_lora_rank)
    write_safetensors(path, {f"{prefix}kv_b_proj.weight": ("BF16", float32_to_bf16_bits(w))})


# --------------------------------------------------------------------------- cache bytes


def dequantize_slots(raw: np.ndarray, cache_dtype: str, L: int, R: int,
                     k_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(c ``[T, L]``, k_pe ``[T, R]``) in float64 from ReadCache bytes (CONTRACT §2 layouts)."""
    raw = np.ascontiguousarray(raw)
    t = raw.shape[0]
    if cache_dtype == "auto":
        vals = bf16_bits_to_float32(raw.view("<u2").reshape(t, L + R)).astype(np.float64)
        return vals[:, :L], vals[:, L:]
    if cache_dtype == "fp8":
        vals = fp8_e4m3_bits_to_float32(raw.reshape(t, L + R)).astype(np.float64) * k_scale
        return vals[:, :L], vals[:, L:]
    if cache_dtype == "fp8_ds_mla":
        tiles = L // 128
        c8 = fp8_e4m3_bits_to_float32(raw[:, :L]).astype(np.float64)
        scales = raw[:, L : L + 4 * tiles].copy().view("<f4").astype(np.float64)  # [T, tiles]
        c = (c8.reshape(t, tiles, 128) * scales[:, :, None]).reshape(t, L)
        c = bf16_bits_to_float32(float32_to_bf16_bits(c.astype(np.float32))).astype(np.float64)
        kpe = bf16_bits_to_float32(raw[:, L + 4 * tiles : L + 4 * tiles + 2 * R].copy().view("<u2")).astype(np.float64)
        return c, kpe
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")


def check_cache_bytes(raw: np.ndarray, cache_dtype: str, c_bits: np.ndarray, kpe_bits: np.ndarray,
                      k_scale: float) -> int:
    """Bytes of ReadCache output that differ from what CONTRACT §2's insert must store for the
    bf16 latents written (bit-exact for "auto" and "fp8"; only k_pe for "fp8_ds_mla",
    whose latent bytes depend on the tile scales)."""
    raw = np.ascontiguousarray(raw)
    t, L = c_bits.shape
    vals = np.concatenate([c_bits, kpe_bits], axis=1)
    if cache_dtype == "auto":
        want = vals.astype("<u2").view(np.uint8)
        return int(np.count_nonzero(raw != want))
    if cache_dtype == "fp8":
        x = bf16_bits_to_float32(vals) / np.float32(k_scale)
        return int(np.count_nonzero(raw != float32_to_fp8_e4m3_bits(x)))
    if cache_dtype == "fp8_ds_mla":
        at = L + 4 * (L // 128)
        want = kpe_bits.astype("<u2").view(np.uint8)
        return int(np.count_nonzero(raw[:, at : at + want.shape[1]] != want))
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")


# --------------------------------------------------------------------------- attention


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                  mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """q [Tq,H,D], k [Tk,H,D], v [Tk,H,Dv] -> (out [Tq,H,Dv], lse [H,Tq]) in float64, natural log.
    ``mask`` [Tq, Tk] bool (True = attend). Rows with no key: out 0, lse -inf."""
    z = np.einsum("thd,shd->hts", q, k) * scale  # [H, Tq, Tk]
    if mask is not None:
        z = np.where(mask[None], z, -np.inf)
    tq = q.shape[0]
    h = q.shape[1]
    if z.shape[2] == 0:
        return np.zeros((tq, h, v.shape[2])), np.full((h, tq), -np.inf)
    m = z.max(axis=2, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(z - m_safe)
    s = p.sum(axis=2, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.einsum("hts,shv->thv", p / np.where(s > 0, s, 1.0), v)
        lse = np.where(s[..., 0] > 0, m_safe[..., 0] + np.log(s[..., 0]), -np.inf)
    return out, lse


# --------------------------------------------------------------------------- the run


def run(
    client: PrefillContextClient,
    w_deq: np.ndarray,
    *,
    context_lens: _Seq[int],
    query_lens: _Seq[int],
    seed: int = 0,
    workspace_tokens: int | None = None,
    rtol: float | None = None,
    shared_memory: bool = False,
    layer: int | None = None,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Run the whole example against ``client``; returns a report dict (``ok`` is the verdict).

    ``shared_memory``: q, the output and the LSE go through a POSIX shared-memory region
    registered with the server (``serve --shared-memory system|all``, same host or same
    IPC namespace) instead of inside the gRPC messages. ``layer``: the model layer to use
    on a server of several (``serve --layers``); ``w_deq`` must be that layer's weight."""
    if len(context_lens) != len(query_lens):
        raise ValueError("context_lens and query_lens need the same length")
    info = client.server_info()
    H, L, P, R, V = info.num_heads, info.kv_lora_rank, info.qk_nope_head_dim, info.qk_rope_head_dim, info.v_head_dim
    bs, scale = info.block_size, info.softmax_scale
    log(
        f"server {info.instance_id}: H={H} L={L} P={P} R={R} V={V} scale={scale:.6g} cache={info.cache_dtype} "
        f"block={bs} blocks={info.num_blocks} kv_b_proj={info.kv_b_proj_dtype} prefill={info.prefill_dtype} "
        f"backend={info.attention_backend} fused={info.fused_kernels_active} device={info.device}"
    )
    if w_deq.shape != (H * (P + V), L):
        raise ValueError(f"weights are {list(w_deq.shape)}, the server needs [{H * (P + V)}, {L}]: wrong file?")
    fp8_prefill = info.prefill_dtype == "fp8"
    if rtol is None:
        rtol = 1e-1 if fp8_prefill else 2e-2
    rng = np.random.default_rng(seed)

    # -- context latents into random distinct blocks
    nblocks = [math.ceil(c / bs) for c in context_lens]
    if sum(nblocks) > info.num_blocks:
        raise ValueError(f"the batch needs {sum(nblocks)} blocks, the server has {info.num_blocks}")
    blocks = rng.permutation(info.num_blocks)[: sum(nblocks)]
    tables, at = [], 0
    for n in nblocks:
        tables.append([int(b) for b in blocks[at : at + n]])
        at += n
    # latent scale chosen so that k_nope = c . W^T has unit variance
    c_std = 1.0 / math.sqrt(float(np.mean(np.sum(w_deq**2, axis=1))))
    total_ctx = sum(context_lens)
    c = rng.standard_normal((total_ctx, L)) * c_std
    kpe = rng.standard_normal((total_ctx, R))
    c_bits, kpe_bits = float32_to_bf16_bits(c), float32_to_bf16_bits(kpe)
    slots = np.concatenate(
        [slot_mapping(table, 0, n, bs) for table, n in zip(tables, context_lens)] or [np.zeros(0, np.int64)]
    )
    if total_ctx:
        written = client.write_cache(slots, RawTensor(BF16, c_bits), RawTensor(BF16, kpe_bits), layer=layer)
        if written != total_ctx:
            raise RuntimeError(f"write_cache wrote {written} slots, expected {total_ctx}")
        raw = client.read_cache(slots, layer=layer)
        if raw.shape != (total_ctx, info.bytes_per_slot):
            raise RuntimeError(f"read_cache returned {list(raw.shape)}, expected [{total_ctx}, {info.bytes_per_slot}]")
        c_ctx, kpe_ctx = dequantize_slots(raw, info.cache_dtype, L, R, info.k_scale)
        cache_mismatches = check_cache_bytes(raw, info.cache_dtype, c_bits, kpe_bits, info.k_scale)
        log(f"cache ({info.cache_dtype}): {total_ctx} slots written and read back, {cache_mismatches} bytes differ")
    else:
        c_ctx, kpe_ctx = np.zeros((0, L)), np.zeros((0, R))
        cache_mismatches = 0

    # -- queries and the new tokens' own keys / values
    tq = sum(query_lens)
    q_f = rng.standard_normal((tq, H, P + R))
    if fp8_prefill:
        q_raw = RawTensor(FP8_E4M3, float32_to_fp8_e4m3_bits(q_f.astype(np.float32)))
    else:
        q_raw = RawTensor(BF16, float32_to_bf16_bits(q_f))
    q = q_raw.to_numpy().astype(np.float64)
    k_new = bf16_bits_to_float32(float32_to_bf16_bits(rng.standard_normal((tq, H, P + R)))).astype(np.float64)
    v_new = bf16_bits_to_float32(float32_to_bf16_bits(rng.standard_normal((tq, H, V)))).astype(np.float64)

    # -- the context part, on the server
    seqs = [Sequence(ql, cl, tuple(bt)) for ql, cl, bt in zip(query_lens, context_lens, tables, strict=True)]
    if shared_memory:
        res = _prefill_through_shared_memory(client, q_raw, seqs, workspace_tokens, f"orchestrator-{seed}", H, V, log,
                                             layer)
    else:
        res = client.prefill_context(q_raw, seqs, workspace_tokens=workspace_tokens, request_id=f"orchestrator-{seed}",
                                     layer=layer)
    st = res.stats
    log(
        f"prefill_context: {st['num_chunks']} chunk(s), path={st['path']}, fp8_path={st['fp8_path']}, "
        f"launches={st['kernel_launches']}, total={st['total_nanos'] / 1e6:.3f} ms"
    )

    # -- the new-token part, locally, and the merge
    out_new = np.zeros((tq, H, V))
    lse_new = np.full((H, tq), -np.inf)
    out_full = np.zeros((tq, H, V))
    lse_full = np.full((H, tq), -np.inf)
    row, ctx_at = 0, 0
    for ql, cl in zip(query_lens, context_lens, strict=True):
        rows = slice(row, row + ql)
        causal = np.tril(np.ones((ql, ql), dtype=bool))
        out_new[rows], lse_new[:, rows] = attention_f64(q[rows], k_new[rows], v_new[rows], scale, causal)
        # full reference over [context | new tokens]
        kv = (c_ctx[ctx_at : ctx_at + cl] @ w_deq.T).reshape(cl, H, P + V)
        k_ctx = np.concatenate([kv[:, :, :P], np.broadcast_to(kpe_ctx[ctx_at : ctx_at + cl, None, :], (cl, H, R))], -1)
        k_all = np.concatenate([k_ctx, k_new[rows]], 0)
        v_all = np.concatenate([kv[:, :, P:], v_new[rows]], 0)
        mask = np.concatenate([np.ones((ql, cl), dtype=bool), causal], 1)
        out_full[rows], lse_full[:, rows] = attention_f64(q[rows], k_all, v_all, scale, mask)
        row += ql
        ctx_at += cl
    if res.output is None or res.lse is None:  # only results placed in CUDA regions lack them
        raise RuntimeError("the PrefillContext result has no output or LSE arrays")
    merged, merged_lse = merge_partials(res.output, res.lse, out_new.astype(np.float32), lse_new.astype(np.float32))

    err = np.abs(merged.astype(np.float64) - out_full)
    max_abs = float(err.max()) if err.size else 0.0
    ref_max = float(np.abs(out_full).max()) if out_full.size else 0.0
    rel = max_abs / ref_max if ref_max > 0 else max_abs
    lse_err = float(np.abs(merged_lse.astype(np.float64) - lse_full).max()) if lse_full.size else 0.0
    lse_tol = rtol  # absolute, in natural-log units
    ok = bool(np.isfinite(merged).all() and rel <= rtol and lse_err <= lse_tol and cache_mismatches == 0)
    log(
        f"merged vs full attention: max abs err {max_abs:.3e}, rel {rel:.3e} (tol {rtol:.1e}); "
        f"lse max abs err {lse_err:.3e} (tol {lse_tol:.1e}) -> {'OK' if ok else 'FAIL'}"
    )
    return {
        "ok": ok,
        "max_abs_err": max_abs,
        "rel_err": rel,
        "lse_abs_err": lse_err,
        "cache_mismatches": cache_mismatches,
        "rtol": rtol,
        "stats": st,
        "instance_id": res.instance_id,
    }


def _prefill_through_shared_memory(client: PrefillContextClient, q_raw: RawTensor, seqs: list[Sequence],
                                   workspace_tokens: int | None, request_id: str, H: int, V: int,
                                   log: Callable[[str], object], layer: int | None = None) -> PrefillResult:
    """prefill_context with q, output and LSE in one POSIX shared-memory region: q at 0,
    the output and the LSE after it (64-byte aligned); the region is registered for the
    call and removed after. The result's arrays are copied out of the region first."""

    def up(n: int) -> int:
        return (n + 63) // 64 * 64

    tq = q_raw.shape[0]
    q_bytes, out_bytes, lse_bytes = q_raw.bits.nbytes, tq * H * V * 2, H * tq * 4
    out_at = up(q_bytes)
    lse_at = out_at + up(out_bytes)
    name = f"orchestrator-{os.getpid()}"
    with SystemSharedMemoryRegion(name, max(lse_at + lse_bytes, 1)) as region:
        client.register_system_shared_memory(region)
        try:
            q_in = region.write(q_raw, 0)
            res = client.prefill_context(q_in, seqs, workspace_tokens=workspace_tokens, request_id=request_id,
                                         output_region=region.ref(out_at, out_bytes),
                                         lse_region=region.ref(lse_at, lse_bytes), layer=layer)
            # copies of the views into the region (output is already a float32 copy), so
            # that the region can be unmapped
            res.output_bits, res.lse = np.array(res.output_bits), np.array(res.lse)
        finally:
            client.unregister_shared_memory(name)
    log(f"shared memory: q ({q_bytes} B), output ({out_bytes} B) and LSE ({lse_bytes} B) through region {name!r}")
    return res


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ctxprefill_client.examples.orchestrator",
        description="Full prefill attention = server context part + local new-token part, merged by LSE, "
        "checked against one float64 attention.",
    )
    ap.add_argument("--target", default="localhost:50051", help="server host:port")
    ap.add_argument("--weights", help="the safetensors file the server was started with (--weights)")
    ap.add_argument("--weights-prefix", default="", help="tensor name prefix, as the server's --weights-prefix "
                                                          "({layer} stands for --layer)")
    ap.add_argument("--layer", type=int, default=None, help="the model layer to use on a server of several "
                                                           "(serve --layers)")
    ap.add_argument("--context-lens", default="200,48,32,0", help="comma-separated context lengths")
    ap.add_argument("--query-lens", default="8,4,6,5", help="comma-separated new-token counts")
    ap.add_argument("--workspace-tokens", type=int, default=None, help="per-request workspace size W")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=None, help="max |err| / max |ref| allowed")
    ap.add_argument("--timeout", type=float, default=120.0, help="deadline of each call, seconds")
    ap.add_argument("--token", default=None, help="bearer token")
    ap.add_argument("--token-file", default=None, help="file holding the bearer token (instead of --token)")
    ap.add_argument("--tls", action="store_true", help="use TLS with the default roots")
    ap.add_argument("--tls-ca", default=None, help="PEM file of the roots that sign the server's certificate "
                                                   "(turns TLS on)")
    ap.add_argument("--write-weights", metavar="PATH", help="write a random bf16 kv_b_proj file and exit")
    ap.add_argument("--heads", type=int, default=16, help="heads for --write-weights")
    ap.add_argument("--shared-memory", choices=["off", "system"], default="off",
                    help="system: q, output and LSE through POSIX shared memory (serve --shared-memory system|all; "
                         "same host or IPC namespace)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    if args.write_weights:
        make_random_weights(args.write_weights, args.heads, seed=args.seed, prefix=args.weights_prefix)
        print(f"wrote {args.write_weights}: {args.weights_prefix}kv_b_proj.weight [{args.heads * 256}, 512] bf16")
        return 0
    if not args.weights:
        ap.error("--weights PATH is required (the same file the server was started with)")
    if "{layer}" in args.weights_prefix and args.layer is None:
        ap.error("--weights-prefix has {layer}: give --layer")
    w_deq = load_kv_b_proj(args.weights, args.weights_prefix.replace("{layer}", str(args.layer)))
    token = args.token
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    with PrefillContextClient(args.target, timeout=args.timeout, token=token, tls=args.tls,
                              root_certificates=args.tls_ca) as client:
        report = run(
            client,
            w_deq,
            context_lens=_ints(args.context_lens),
            query_lens=_ints(args.query_lens),
            seed=args.seed,
            workspace_tokens=args.workspace_tokens,
            rtol=args.rtol,
            shared_memory=args.shared_memory == "system",
            layer=args.layer,
        )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
