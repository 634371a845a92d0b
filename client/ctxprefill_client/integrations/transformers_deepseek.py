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
4. the two partials merged by LSE (:func:`ctxprefill_client.merge_partials`), then
   ``o_proj``.

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
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._common import CtxPrefillError, PrefillResult, Sequence, ServerInfo, ServerRestartedError
from ..merge import merge_partials

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockAllocator",
    "DeepseekV3ChunkedPrefill",
    "IncompatibleServerError",
    "OutOfBlocksError",
    "SequenceState",
]


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
        """Slot of each position in ``[start, end)``: ``table[p // bs] * bs + p % bs`` (int64 ``[end - start]``)."""
        pos = np.arange(start, end, dtype=np.int64)
        return np.asarray(self.block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


@dataclass
class _Step:
    seqs: list[SequenceState]
    starts: list[int]
    tokens: int  # T, new tokens per sequence
    slots: np.ndarray  # int64 [B*T], sequence-major


def _infos(answer: ServerInfo | list[ServerInfo]) -> list[ServerInfo]:
    """``server_info()`` of a plain client (one) or a ShardedPrefillClient (one per shard)."""
    return list(answer) if isinstance(answer, list) else [answer]


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    """uint16 bf16 bits of a tensor (rounded to bf16 if it is not), on the host."""
    import torch

    return t.detach().to(torch.bfloat16).contiguous().cpu().view(torch.int16).numpy().view(np.uint16)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of ``q [B, H, T, D]`` over ``k [B, H, T, D]``, ``v [B, H, T, V]`` in
    float32: ``(out [B*T, H, V], lse [H, B*T])`` (natural log), rows sequence-major."""
    import torch

    B, H, T, _ = q.shape
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, T, T]
    future = torch.ones((T, T), dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, T]
    o = torch.matmul(torch.exp(s - lse[..., None]), v.float())  # [B, H, T, V]
    out = o.permute(0, 2, 1, 3).reshape(B * T, H, -1)
    return out.cpu().numpy(), lse.permute(1, 0, 2).reshape(H, B * T).cpu().numpy()


class DeepseekV3ChunkedPrefill:
    """Runs a transformers ``DeepseekV3ForCausalLM`` (or ``DeepseekV3Model``) chunk by chunk with
    ctxprefill holding every layer's latent cache and computing the attention over the context.

    Args:
        model: the transformers model; its attention modules are patched only while a chunk runs.
        client: a :class:`~ctxprefill_client.PrefillContextClient` or
            :class:`~ctxprefill_client.ShardedPrefillClient` of a server holding the model's
            layers (``serve --model DIR``, or ``--weights`` with ``--layers`` and
            ``--softmax-scale``); checked against the model here.
        allocator: the server's blocks (default: all of them, for this runner alone).
        write_with_prefill: write a chunk's latents with PrefillContext's ``cache_write``
            (one call per layer and chunk); False: a WriteCache, then PrefillContext.
        keep_latents: keep a host copy of every latent written, so that a restarted server
            (``ServerRestartedError``: its cache is gone) is rewritten and the call retried.
        timeout: deadline of each call (default: the client's).
    """

    def __init__(self, model: Any, client: Any, *, allocator: BlockAllocator | None = None,
                 write_with_prefill: bool = True, keep_latents: bool = True, timeout: float | None = None) -> None:
        self.model = model
        self.client = client
        base = getattr(model, "model", model)
        self._attention_modules: list[Any] = [layer.self_attn for layer in base.layers]
        self.write_with_prefill = write_with_prefill
        self.keep_latents = keep_latents
        self.timeout = timeout
        info = self._check(client.server_info(timeout=timeout))
        self.block_size = info.block_size
        self.prefill_dtype = info.prefill_dtype
        self.allocator = allocator if allocator is not None else BlockAllocator(info.num_blocks)
        self.calls = 0  # PrefillContext calls made
        self.restarts = 0  # server restarts recovered by rewrite_cache
        self._step: _Step | None = None
        self._next_id = 0
        # layer -> (seq_id, start) -> (slots, kv_c bits, k_pe bits): what the cache holds
        self._latents: dict[int, dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    # ------------------------------------------------------------------ checks

    def _check(self, answer: ServerInfo | list[ServerInfo]) -> ServerInfo:
        info = _infos(answer)[0]
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
        ``[B, T, vocab]`` (a ``DeepseekV3Model``: its last hidden state) and advances the sequences."""
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
        try:
            with torch.no_grad():
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        finally:
            for m, orig in zip(self._attention_modules, originals, strict=True):
                if orig is None:
                    del m.forward
                else:
                    m.forward = orig
            self._step = None
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

        q_rows = query.transpose(1, 2).reshape(B * T, H, P + R)
        q_wire = q_rows.float().cpu().numpy() if self.prefill_dtype == "fp8" else _bf16_bits(q_rows)
        res = self._context(int(attn.layer_idx), step, q_wire,
                            _bf16_bits(kv_c.reshape(B * T, L)), _bf16_bits(k_pe.reshape(B * T, R)))
        if res.output is None or res.lse is None:
            raise CtxPrefillError("PrefillContext returned no inline output (shared-memory results are not read here)")
        out, _ = merge_partials(out_local, lse_local, res.output, res.lse)
        merged = torch.from_numpy(out).to(device=hidden_states.device, dtype=hidden_states.dtype)
        return attn.o_proj(merged.reshape(B, T, -1)), None

    def _context(self, layer: int, step: _Step, q: np.ndarray, kv_c: np.ndarray, k_pe: np.ndarray) -> PrefillResult:
        """PrefillContext over each sequence's ``start`` cached tokens, writing the chunk's latents."""
        seqs = [Sequence(step.tokens, start, tuple(s.block_table))
                for s, start in zip(step.seqs, step.starts, strict=True)]
        write = (step.slots, kv_c, k_pe)

        def call() -> PrefillResult:
            if self.write_with_prefill:
                r: PrefillResult = self.client.prefill_context(q, seqs, layer=layer, cache_write=write,
                                                               timeout=self.timeout)
                return r
            self.client.write_cache(*write, layer=layer, timeout=self.timeout)
            r = self.client.prefill_context(q, seqs, layer=layer, timeout=self.timeout)
            return r

        try:
            res = call()
        except ServerRestartedError:
            if not self.keep_latents:
                raise
            self.rewrite_cache()
            self.restarts += 1
            res = call()
        self.calls += 1
        if self.keep_latents:
            kept = self._latents.setdefault(layer, {})
            T = step.tokens
            for b, (s, start) in enumerate(zip(step.seqs, step.starts, strict=True)):
                rows = slice(b * T, (b + 1) * T)
                kept[(s.seq_id, start)] = (step.slots[rows], kv_c[rows], k_pe[rows])
        return res

    def rewrite_cache(self) -> int:
        """After a server restart: forget its instance, check the new one against the model and
        write every kept latent of every layer again. Returns the slots written."""
        if not self.keep_latents:
            raise CtxPrefillError("rewrite_cache needs keep_latents=True")
        self.client.reset_instance()
        self._check(self.client.server_info(timeout=self.timeout))
        written = 0
        for layer, kept in self._latents.items():
            if kept:
                parts = list(kept.values())
                written += int(self.client.write_cache(
                    np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                    np.concatenate([p[2] for p in parts]), layer=layer, timeout=self.timeout))
        return written
