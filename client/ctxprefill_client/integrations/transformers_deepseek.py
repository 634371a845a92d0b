"""Chunked prefill of a transformers DeepSeek-V3 / Kimi-K2 model whose attention over earlier
chunks is computed by ctxprefill (docs/INTEGRATION.md).

For a chunk of new tokens (``input_ids [B, T]``, sequence b at positions
``[start_b, start_b + T)``), every layer's ``DeepseekV3Attention`` runs, in place of its own
forward:

1. q, the normalized latent ``kv_a_layernorm(c)`` and the rotated ``k_pe``, computed as
   the model computes them (q_a_proj → q_a_layernorm → q_b_proj, kv_a_proj_with_mqa, RoPE
   with the model's cos/sin, YaRN included);
2. the chunk's causal attention over itself, here: k and v expanded through the model's
   ``kv_b_proj`` (``expand_kv``), softmax in float32 → ``out_local [B*T, H, V]``,
   ``lse_local [H, B*T]``;
3. the attention over the ``start_b`` earlier tokens from ctxprefill's PrefillContext
   (q = ``[q_nope | q_pe]`` per head, bf16; ``context_len = start_b``; the sequence's block
   table), which also writes the chunk's latents into its slots (``cache_write``; or a
   WriteCache before it with ``write_with_prefill=False``);
4. the two partials merged by LSE on the model's device (:func:`merge_partials_torch`, the
   formula of :func:`ctxprefill_client.merge_partials`), then ``o_proj``.

Transports (``transport=``): ``"inline"`` sends q and the latents as bytes and gets output
and LSE back as bytes; ``"cuda"`` (the model on a CUDA device, the server on the same host
with ``--shared-memory cuda`` or ``all``) registers one CUDA region of the model's device
once, holding q, the latents, output and LSE for up to ``max_chunk_tokens`` rows, and passes
references to it: q and the latents (``cache_write``) are read in place by the server, output
and LSE written straight into it. Only the slot mapping travels inline (the server checks
it on the host).

Every chunk's time is recorded in :attr:`DeepseekV3ChunkedPrefill.timings`
(:class:`ChunkTiming`): the local work, the client-observed ctxprefill calls and the
server's own time.

Embeddings, norms, MLP / MoE, residuals and lm_head stay the model's own. torch and
transformers are imported when a chunk runs; importing this module imports neither.

    from ctxprefill_client import PrefillContextClient
    from ctxprefill_client.integrations.transformers_deepseek import DeepseekV3ChunkedPrefill

    with PrefillContextClient("localhost:50051") as client:
        runner = DeepseekV3ChunkedPrefill(model, client)    # checks the server against the model
        logits, seqs = runner.prefill(input_ids, chunk_size=2048)
        ...
        runner.release(seqs)
"""

from __future__ import annotations

import functools
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._common import CtxPrefillError, PrefillResult, Sequence, ServerInfo, ServerRestartedError
from ..shared_memory import SharedMemoryRef, SharedMemoryTensor
from ..tensors import BF16, FP8_E4M3, FP32, slot_mapping

if TYPE_CHECKING:
    import torch

__all__ = [
    "TRANSPORTS",
    "BlockAllocator",
    "ChunkTiming",
    "DeepseekV3ChunkedPrefill",
    "IncompatibleServerError",
    "OutOfBlocksError",
    "SequenceState",
    "merge_partials_torch",
]

TRANSPORTS = ("inline", "cuda")


class OutOfBlocksError(CtxPrefillError):
    """The allocator has fewer free blocks than a chunk needs."""


class IncompatibleServerError(CtxPrefillError):
    """The server's shapes, layers or softmax scale are not the model's (the field is named)."""


class BlockAllocator:
    """Free list of the server's cache blocks ``[0, num_blocks)``, handed out first in, first out."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} cache blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)


@dataclass
class SequenceState:
    """One sequence's place in the cache: its block table and the tokens cached (in every layer)."""

    seq_id: int
    block_table: list[int] = field(default_factory=list)
    length: int = 0

    def slots(self, start: int, end: int, block_size: int) -> np.ndarray:
        """Slot of each position in ``[start, end)`` (int64 ``[end - start]``; :func:`slot_mapping`)."""
        return slot_mapping(self.block_table, start, end, block_size)


@dataclass
class _Step:
    seqs: list[SequenceState]
    starts: list[int]
    tokens: int  # T, new tokens per sequence
    slots: np.ndarray  # int64 [B*T], sequence-major


@dataclass(frozen=True)
class ChunkTiming:
    """One :meth:`~DeepseekV3ChunkedPrefill.prefill_chunk`, in seconds: ``total_s`` (the device
    synchronized at both ends) = ``local_s`` + ``remote_s``. ``remote_s``: the client's wall
    time inside its ctxprefill calls (one per layer; with ``write_with_prefill=False`` the
    WriteCache too), the device synchronized before each; ``local_s``: everything else, the
    model's own work (projections, the chunk's causal attention, merges, MLP, lm_head) and
    the moves into and out of the transport (copies into the CUDA region, or to and from the
    host inline). ``server_total_s`` / ``server_compute_s``: the PrefillContext answers'
    ``Stats.total_nanos`` / ``compute_nanos``, summed over the layers."""

    index: int  # the runner's chunk count when it ran, from 0
    tokens: int  # new tokens, every sequence of the batch
    context_tokens: int  # cached tokens attended over, summed over the sequences
    calls: int  # PrefillContext calls (one per layer)
    total_s: float
    local_s: float
    remote_s: float
    server_total_s: float
    server_compute_s: float


def _bf16_bits(t: Any) -> np.ndarray:
    """uint16 bf16 bits of a tensor (rounded to bf16 if it is not), on the host; a numpy array
    is taken as those bits already."""
    if isinstance(t, np.ndarray):
        return t
    import torch

    bits: np.ndarray = t.detach().to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().view(np.uint16)
    return bits


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q [B, H, T, D]`` over ``k [B, H, T, D]``, ``v [B, H, T, V]`` in
    float32 on their device: ``(out [B*T, H, V], lse [H, B*T])`` (natural log), rows sequence-major."""
    import torch

    B, H, T, _ = q.shape
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, T, T]
    future = torch.ones((T, T), dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, T]
    o = torch.matmul(torch.exp(s - lse[..., None]), v.float())  # [B, H, T, V]
    return o.permute(0, 2, 1, 3).reshape(B * T, H, -1), lse.permute(1, 0, 2).reshape(H, B * T)


def merge_partials_torch(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                         lse_b: torch.Tensor) -> torch.Tensor:
    """:func:`ctxprefill_client.merge_partials` on torch tensors of one device: ``out [T, H, V]``
    (any float dtype), ``lse [H, T]`` natural log; returns the merged ``out`` in float32. An
    empty partial (LSE ``-inf``, or ``+inf``) weighs nothing whatever its ``out`` holds; a row
    empty on both sides is 0."""
    import torch

    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or tuple(lse_a.shape) != (out_a.shape[1],
                                                                                          out_a.shape[0]):
        raise ValueError(f"merge: out {list(out_a.shape)} / {list(out_b.shape)}, lse {list(lse_a.shape)} / "
                         f"{list(lse_b.shape)}: expected out [T, H, V] and lse [H, T] on both sides")
    la = torch.where(torch.isinf(lse_a), float("-inf"), lse_a.float())
    lb = torch.where(torch.isinf(lse_b), float("-inf"), lse_b.float())
    empty_a, empty_b = torch.isneginf(la), torch.isneginf(lb)
    both = empty_a & empty_b
    m = torch.where(both, 0.0, torch.maximum(la, lb))
    w_a = torch.where(empty_a, 0.0, torch.exp(la - m))
    w_b = torch.where(empty_b, 0.0, torch.exp(lb - m))
    denom = torch.where(both, 1.0, w_a + w_b)
    wa, wb = (w_a / denom).T[:, :, None], (w_b / denom).T[:, :, None]  # [T, H, 1], normalized first
    part_a = torch.where(empty_a.T[:, :, None], 0.0, out_a.float() * wa)
    part_b = torch.where(empty_b.T[:, :, None], 0.0, out_b.float() * wb)
    return part_a + part_b


class _CudaBuffers:
    """One CUDA region (a uint8 tensor on the model's device, registered once) holding, for up
    to ``rows`` query rows, q ``[rows, H, P+R]`` (bf16, or fp8 e4m3 for an fp8-prefill server),
    kv_c ``[rows, L]`` and k_pe ``[rows, R]`` (bf16), output ``[rows, H, V]`` (bf16) and LSE
    ``[H, rows]`` (fp32), each at a 256-byte-aligned offset."""

    ALIGN = 256

    def __init__(self, client: Any, device: torch.device, rows: int, heads: int, qk: int, v: int, latent: int,
                 rope: int, fp8_q: bool) -> None:
        import torch

        from ..shared_memory import CudaSharedMemoryRegion

        self.client, self.rows, self.heads = client, rows, heads
        self.q_wire = FP8_E4M3 if fp8_q else BF16
        self.dims = {"q": (heads, qk), "kv_c": (latent,), "k_pe": (rope,), "out": (heads, v)}
        sizes = {"q": rows * heads * qk * (1 if fp8_q else 2), "kv_c": rows * latent * 2, "k_pe": rows * rope * 2,
                 "out": rows * heads * v * 2, "lse": heads * rows * 4}
        self.offsets: dict[str, int] = {}
        at = 0
        for name, n in sizes.items():
            self.offsets[name] = at
            at += -(-n // self.ALIGN) * self.ALIGN
        self.tensor = torch.empty(at, dtype=torch.uint8, device=device)
        self.region = CudaSharedMemoryRegion(f"ctxprefill-hf-{uuid.uuid4().hex[:12]}", self.tensor)
        self.registered = False
        self.register()

    def register(self) -> None:
        """(Again, after a server restart: a new instance knows no regions.)"""
        self.client.register_cuda_shared_memory(self.region)
        self.registered = True

    def close(self) -> None:
        if self.registered:
            self.client.unregister_shared_memory(self.region.name)  # raises: the server may still hold it
            self.registered = False
        self.region.close()  # torch may reuse the memory once the tensor is freed

    def stage(self, q: torch.Tensor, kv_c: torch.Tensor,
              k_pe: torch.Tensor) -> tuple[SharedMemoryTensor, SharedMemoryTensor, SharedMemoryTensor,
                                           SharedMemoryRef, SharedMemoryRef]:
        """Copy ``q [n, H, P+R]``, ``kv_c [n, L]``, ``k_pe [n, R]`` into the region, wait for the
        device (the server reads them once the call arrives), and return the inputs and the
        output / LSE ranges for ``n`` rows."""
        import torch

        n = int(q.shape[0])
        if n > self.rows:
            raise ValueError(f"the chunk has {n} query rows (batch x tokens), the CUDA region holds max_chunk_tokens="
                             f"{self.rows}: make max_chunk_tokens larger or the chunks smaller")
        r, off = self.region, self.offsets
        inputs = []
        for name, wire, x in (("q", self.q_wire, q), ("kv_c", BF16, kv_c), ("k_pe", BF16, k_pe)):
            shape = (n, *self.dims[name])
            r.view(wire, shape, off[name]).copy_(x.reshape(shape))
            inputs.append(r.input(wire, shape, off[name]))
        torch.cuda.current_stream(self.tensor.device).synchronize()  # written before the server reads them
        out = r.ref(off["out"], n * self.heads * self.dims["out"][1] * 2)
        lse = r.ref(off["lse"], self.heads * n * 4)
        return inputs[0], inputs[1], inputs[2], out, lse

    def results(self, res: PrefillResult, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The output ``[n, H, V]`` (bf16) and LSE ``[H, n]`` the server wrote into the region."""
        if res.output_ref is None or res.lse_ref is None:
            raise CtxPrefillError("PrefillContext answered inline; the request asked for the CUDA region")
        v = self.dims["out"][1]
        return (self.region.view(BF16, (n, self.heads, v), self.offsets["out"]),
                self.region.view(FP32, (self.heads, n), self.offsets["lse"]))


class DeepseekV3ChunkedPrefill:
    """Runs a transformers ``DeepseekV3ForCausalLM`` (or ``DeepseekV3Model``) chunk by chunk with
    ctxprefill holding every layer's latent cache and computing the attention over the context.

    Args:
        model: the transformers model; its attention modules are patched only while a chunk runs.
        client: a :class:`~ctxprefill_client.PrefillContextClient` or
            :class:`~ctxprefill_client.ShardedPrefillClient` of a server holding the model's
            layers (``serve --model DIR``, or ``--weights`` with ``--layers`` and
            ``--softmax-scale``); checked against the model here.
        transport: ``"inline"`` (bytes in the messages) or ``"cuda"`` (a CUDA region of the
            model's device; one PrefillContextClient of a server on the same host with
            ``--shared-memory cuda`` or ``all``). Call :meth:`close` (or use the runner as a
            context manager) to unregister the region.
        max_chunk_tokens: query rows (batch x chunk tokens) the CUDA region holds.
        allocator: the server's blocks (default: all of them, for this runner alone).
        write_with_prefill: write a chunk's latents with PrefillContext's ``cache_write``
            (one call per layer and chunk); False: a WriteCache, then PrefillContext.
        keep_latents: keep a copy of every latent written (on the host inline, on the device
            with ``"cuda"``), so that a restarted server (``ServerRestartedError``: its cache
            and regions are gone) is rewritten and the call retried.
        timeout: deadline of each call (default: the client's).
    """

    def __init__(self, model: Any, client: Any, *, transport: str = "inline", max_chunk_tokens: int = 8192,
                 allocator: BlockAllocator | None = None, write_with_prefill: bool = True, keep_latents: bool = True,
                 timeout: float | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.model = model
        self.client = client
        self.transport = transport
        base = getattr(model, "model", model)
        self._attention_modules: list[Any] = [layer.self_attn for layer in base.layers]
        self.write_with_prefill = write_with_prefill
        self.keep_latents = keep_latents
        self.timeout = timeout
        answer = client.server_info(timeout=timeout)
        info = self._check(answer)
        self.block_size = info.block_size
        self.prefill_dtype = info.prefill_dtype
        self.allocator = allocator if allocator is not None else BlockAllocator(info.num_blocks)
        self.calls = 0  # PrefillContext calls made
        self.restarts = 0  # server restarts recovered by rewrite_cache
        self.timings: list[ChunkTiming] = []  # one per prefill_chunk
        self._step: _Step | None = None
        self._next_id = 0
        self._remote = [0.0, 0.0, 0.0]  # this chunk: client wall, server total, server compute (s)
        # layer -> (seq_id, start) -> (slots, kv_c, k_pe): what the cache holds (bf16 bits, or device tensors)
        self._latents: dict[int, dict[tuple[int, int], tuple[np.ndarray, Any, Any]]] = {}
        self._buffers: _CudaBuffers | None = None
        if transport == "cuda":
            self._buffers = self._cuda_buffers(answer, info, max_chunk_tokens)

    def _cuda_buffers(self, answer: Any, info: ServerInfo, rows: int) -> _CudaBuffers:
        if isinstance(answer, list) or not hasattr(self.client, "register_cuda_shared_memory"):
            raise ValueError("transport='cuda' needs one PrefillContextClient (a sharded client sends inline)")
        if "cuda" not in info.shared_memory_kinds:
            raise IncompatibleServerError(
                f"shared_memory_kinds: the server offers {list(info.shared_memory_kinds)}, transport='cuda' needs "
                f"'cuda' (serve --shared-memory cuda or all, on the model's host)")
        device = next(self.model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"transport='cuda': the model is on {device}; CUDA IPC needs the model on a CUDA device")
        if rows < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {rows}")
        a = self._attention_modules[0]
        return _CudaBuffers(self.client, device, rows, info.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim,
                            a.v_head_dim, a.kv_lora_rank, a.qk_rope_head_dim, info.prefill_dtype == "fp8")

    def close(self) -> None:
        """Unregister the CUDA region (``transport="cuda"``); the cache and the blocks stay."""
        if self._buffers is not None:
            self._buffers.close()

    def __enter__(self) -> DeepseekV3ChunkedPrefill:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ checks

    def _check(self, answer: ServerInfo | list[ServerInfo]) -> ServerInfo:
        """``answer``: ``server_info()`` of a plain client, or a ShardedPrefillClient's (one per
        shard, checked against each other by that client: the first stands for all)."""
        info = answer[0] if isinstance(answer, list) else answer
        cfg = self.model.config
        want = {
            "total_heads": cfg.num_attention_heads,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
        }
        for name, value in want.items():
            if getattr(info, name) != value:
                raise IncompatibleServerError(f"{name}: the server has {getattr(info, name)}, the model {value}")
        layers = [int(a.layer_idx) for a in self._attention_modules]
        missing = [i for i in layers if i not in info.layers]
        if missing:
            raise IncompatibleServerError(
                f"layers: the server holds layers [{info.layers.start}, {info.layers.stop}), "
                f"the model also needs {missing}")
        scale = float(self._attention_modules[0].scaling)
        if abs(info.softmax_scale - scale) > 1e-6 * scale:
            raise IncompatibleServerError(
                f"softmax_scale: the server uses {info.softmax_scale!r}, the model {scale!r} (YaRN mscale included)")
        return info

    # ------------------------------------------------------------------ sequences

    def new_sequences(self, n: int) -> list[SequenceState]:
        """``n`` empty sequences (no blocks yet)."""
        seqs = [SequenceState(self._next_id + i) for i in range(n)]
        self._next_id += n
        return seqs

    def release(self, seqs: Iterable[SequenceState]) -> None:
        """Give the sequences' blocks back (and forget their kept latents)."""
        for s in seqs:
            self.allocator.free(s.block_table)
            s.block_table, s.length = [], 0
            for kept in self._latents.values():
                for key in [k for k in kept if k[0] == s.seq_id]:
                    del kept[key]

    def _reserve(self, seq: SequenceState, length: int) -> None:
        need = -(-length // self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self.allocator.allocate(need))

    # ------------------------------------------------------------------ prefill

    def prefill(self, input_ids: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, list[SequenceState]]:
        """The whole prompt ``input_ids [B, T]`` in chunks of ``chunk_size`` tokens (the last may be
        shorter): ``(logits [B, T, vocab], the sequences)``; the sequences keep their blocks."""
        import torch

        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        seqs = self.new_sequences(int(input_ids.shape[0]))
        parts = [self.prefill_chunk(input_ids[:, i:i + chunk_size], seqs)
                 for i in range(0, int(input_ids.shape[1]), chunk_size)]
        return torch.cat(parts, dim=1), seqs

    def prefill_chunk(self, input_ids: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
        """One chunk: ``input_ids [B, T]``, row b the next T tokens of ``seqs[b]`` (positions
        ``[seqs[b].length, + T)``; sequences may be at different lengths). Returns the logits
        ``[B, T, vocab]`` (a ``DeepseekV3Model``: its last hidden state), advances the sequences
        and appends the chunk's :class:`ChunkTiming` to :attr:`timings`."""
        import torch

        B, T = (int(d) for d in input_ids.shape)
        if len(seqs) != B:
            raise ValueError(f"seqs: {len(seqs)} sequences for a batch of {B} rows")
        if T < 1:
            raise ValueError("input_ids: the chunk is empty")
        starts = [s.length for s in seqs]
        for s, start in zip(seqs, starts, strict=True):
            self._reserve(s, start + T)
        slots = np.concatenate([s.slots(start, start + T, self.block_size)
                                for s, start in zip(seqs, starts, strict=True)])
        device = input_ids.device
        position_ids = torch.stack([torch.arange(start, start + T, device=device) for start in starts])
        self._step = _Step(seqs, starts, T, slots)
        originals = [m.__dict__.get("forward") for m in self._attention_modules]
        for m in self._attention_modules:
            m.forward = functools.partial(self._attention, m)
        calls = self.calls
        _sync(device)
        self._remote = [0.0, 0.0, 0.0]
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
            _sync(device)
        finally:
            for m, orig in zip(self._attention_modules, originals, strict=True):
                if orig is None:
                    del m.forward
                else:
                    m.forward = orig
            self._step = None
        total = time.perf_counter() - t0
        remote, server_total, server_compute = self._remote
        self.timings.append(ChunkTiming(len(self.timings), B * T, sum(starts), self.calls - calls, total,
                                        total - remote, remote, server_total, server_compute))
        for s in seqs:
            s.length += T
        logits = getattr(out, "logits", None)
        result: torch.Tensor = logits if logits is not None else out.last_hidden_state
        return result

    # ------------------------------------------------------------------ one layer

    def _attention(self, attn: Any, hidden_states: torch.Tensor, position_embeddings: tuple[Any, Any],
                   attention_mask: Any = None, past_key_values: Any = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
        """DeepseekV3Attention.forward for one chunk: local causal part + ctxprefill's context part."""
        import torch
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

        step = self._step
        assert step is not None, "the attention runs only inside prefill_chunk"
        B, T, _ = hidden_states.shape
        H, P, R, L = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank

        if attn.q_lora_rank is None:
            q = attn.q_proj(hidden_states)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
        q = q.view(B, T, H, P + R).transpose(1, 2)  # [B, H, T, P+R]
        q_nope, q_pe = torch.split(q, [P, R], dim=-1)

        kv_c, k_pe = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [L, R], dim=-1)
        kv_c = attn.kv_a_layernorm(kv_c).view(B, 1, T, L)  # the normalized latent: what MLA caches
        k_pe = k_pe.view(B, 1, T, R)
        cos, sin = position_embeddings
        rope = mdl.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else mdl.apply_rotary_pos_emb
        q_pe, k_pe = rope(q_pe, k_pe, cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)

        key, value = attn.expand_kv(kv_c, k_pe)  # [B, H, T, P+R], [B, H, T, V]
        out_local, lse_local = _causal_attention(query, key, value, float(attn.scaling))

        layer, n = int(attn.layer_idx), B * T
        q_rows = query.transpose(1, 2).reshape(n, H, P + R)
        kv_rows, pe_rows = kv_c.reshape(n, L), k_pe.reshape(n, R)
        if self._buffers is not None:
            q_in, kv_in, pe_in, out_ref, lse_ref = self._buffers.stage(q_rows, kv_rows, pe_rows)
            keep = (kv_rows.to(torch.bfloat16).clone(), pe_rows.to(torch.bfloat16).clone()) if self.keep_latents \
                else None
            res = self._context(layer, step, q_in, kv_in, pe_in, keep, out_ref, lse_ref)
            out_ctx, lse_ctx = self._buffers.results(res, n)
        else:
            q_wire = q_rows.float().cpu().numpy() if self.prefill_dtype == "fp8" else _bf16_bits(q_rows)
            kv_bits, pe_bits = _bf16_bits(kv_rows), _bf16_bits(pe_rows)
            res = self._context(layer, step, q_wire, kv_bits, pe_bits, (kv_bits, pe_bits))
            if res.output is None or res.lse is None:
                raise CtxPrefillError("PrefillContext returned no inline output")
            out_ctx = torch.tensor(res.output, device=hidden_states.device)
            lse_ctx = torch.tensor(res.lse, device=hidden_states.device)
        merged = merge_partials_torch(out_local, lse_local, out_ctx, lse_ctx).to(hidden_states.dtype)
        return attn.o_proj(merged.reshape(B, T, -1)), None

    def _context(self, layer: int, step: _Step, q: Any, kv_c: Any, k_pe: Any, keep: tuple[Any, Any] | None,
                 output_region: SharedMemoryRef | None = None,
                 lse_region: SharedMemoryRef | None = None) -> PrefillResult:
        """PrefillContext over each sequence's ``start`` cached tokens, writing the chunk's latents
        (``q``, ``kv_c``, ``k_pe``: bf16 bits / float arrays, or inputs in the CUDA region);
        ``keep``: the latents to keep for a restart."""
        seqs = [Sequence(step.tokens, start, tuple(s.block_table))
                for s, start in zip(step.seqs, step.starts, strict=True)]
        write = (step.slots, kv_c, k_pe)
        # the result ranges only when there are some (a ShardedPrefillClient takes none)
        results = {} if output_region is None else {"output_region": output_region, "lse_region": lse_region}

        def call() -> PrefillResult:
            if self.write_with_prefill:
                r: PrefillResult = self.client.prefill_context(q, seqs, layer=layer, cache_write=write,
                                                               timeout=self.timeout, **results)
                return r
            self.client.write_cache(*write, layer=layer, timeout=self.timeout)
            r = self.client.prefill_context(q, seqs, layer=layer, timeout=self.timeout, **results)
            return r

        t0 = time.perf_counter()
        try:
            res = call()
        except ServerRestartedError:
            if not self.keep_latents:
                raise
            self.rewrite_cache()
            self.restarts += 1
            res = call()
        self._remote[0] += time.perf_counter() - t0
        self._remote[1] += float(res.stats.get("total_nanos", 0)) / 1e9
        self._remote[2] += float(res.stats.get("phase_nanos", {}).get("compute", 0)) / 1e9
        self.calls += 1
        if self.keep_latents and keep is not None:
            kept = self._latents.setdefault(layer, {})
            T = step.tokens
            for b, (s, start) in enumerate(zip(step.seqs, step.starts, strict=True)):
                rows = slice(b * T, (b + 1) * T)
                kept[(s.seq_id, start)] = (step.slots[rows], keep[0][rows], keep[1][rows])
        return res

    def rewrite_cache(self) -> int:
        """After a server restart: forget its instance, check the new one against the model,
        register the CUDA region again (``transport="cuda"``) and write every kept latent of
        every layer again. Returns the slots written."""
        if not self.keep_latents:
            raise CtxPrefillError("rewrite_cache needs keep_latents=True")
        self.client.reset_instance()
        self._check(self.client.server_info(timeout=self.timeout))
        if self._buffers is not None:
            self._buffers.register()
        written = 0
        for layer, kept in self._latents.items():
            if kept:
                parts = list(kept.values())
                written += int(self.client.write_cache(
                    np.concatenate([p[0] for p in parts]), np.concatenate([_bf16_bits(p[1]) for p in parts]),
                    np.concatenate([_bf16_bits(p[2]) for p in parts]), layer=layer, timeout=self.timeout))
        return written
