"""Head-sharded workers: one client over N ``ctxprefill serve --num-shards N`` workers.

A tensor-parallel deployment of an MLA model splits the attention heads across ranks
while every rank keeps the whole latent cache. Served that way (docs/SHARDING.md),
worker ``i`` of ``N`` owns heads ``[i*H/N, (i+1)*H/N)`` of the model's ``H`` and the
matching rows of ``kv_b_proj``; every worker holds the same cache contents.

    from ctxprefill_client.sharded import ShardedPrefillClient

    with ShardedPrefillClient(["gpu0:50051", "gpu1:50051"], timeout=60) as sc:
        sc.server_info()                       # discovers and checks the head layout
        sc.write_cache(slots, kv_c, k_pe)      # the same latents to every shard
        res = sc.prefill_context(q, seqs)      # q [Tq, H_total, P+R]
        res.output, res.lse                    # [Tq, H_total, V], [H_total, Tq]

``prefill_context`` splits ``q`` by heads (contiguous slices of one rounding to the
wire dtype), runs all shards concurrently, and concatenates ``output`` along heads
(axis 1) and ``lse`` along heads (axis 0). The result equals one unsharded worker's,
bit for bit, when the shards and that worker run the same weights, cache contents,
chunk plan and kernels (see docs/SHARDING.md for why and for the GPU caveat).

Each shard has its own :class:`~ctxprefill_client.PrefillContextClient` and so its
own instance tracking: a restarted shard (its cache gone) raises
:class:`~ctxprefill_client.ServerRestartedError`, annotated with ``shard_index`` and
``shard_target``. Re-populate the cache (``write_cache`` writes every shard), then
``reset_instance()``.

numpy only (no torch); the asyncio twin is :class:`AsyncShardedPrefillClient`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from ._common import CtxPrefillError, PrefillResult, ServerInfo
from .aio import AsyncPrefillContextClient
from .client import PrefillContextClient
from .tensors import (
    BF16,
    FP8_E4M3,
    RawTensor,
    float32_to_bf16_bits,
    float32_to_fp8_e4m3_bits,
)

_T = TypeVar("_T")

__all__ = [
    "AsyncShardedPrefillClient",
    "ShardLayoutError",
    "ShardedPrefillClient",
    "ShardedPrefillResult",
    "ShardedReadMismatchError",
    "check_layout",
    "concat_results",
    "split_q",
]

#: ServerInfo fields every shard must agree on (cache layout, dtypes, shapes)
SAME_FIELDS = (
    "num_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "softmax_scale",
    "cache_dtype",
    "block_size",
    "num_blocks",
    "k_scale",
    "bytes_per_slot",
    "kv_b_proj_dtype",
    "kv_b_proj_scale_format",
    "prefill_dtype",
    "total_heads",
    "num_shards",
    "num_layers",
    "first_layer",
)


class ShardLayoutError(CtxPrefillError):
    """The targets do not form one head-sharded model (heads not tiling [0, H) exactly,
    or shards that disagree on the cache, shapes or dtypes)."""


class ShardedReadMismatchError(CtxPrefillError):
    """``read_cache(verify=True)``: the shards hold different bytes for the same slots."""


@dataclasses.dataclass
class ShardedPrefillResult(PrefillResult):
    """:class:`PrefillResult` of the whole model, plus each shard's own.

    ``output`` ``[Tq, H_total, V]`` and ``lse`` ``[H_total, Tq]`` are the shards'
    concatenated along heads. ``stats`` merges theirs: ``kernel_launches`` summed over
    shards (every launch on every GPU), ``stage_nanos`` and ``total_nanos`` the maximum
    over shards (they run in parallel: the slowest decides; ``phase_nanos`` that shard's
    parts of it), the plan, path and token
    counts from shard 0 (checked equal on all), and ``stats["shards"]``: each shard's
    stats dict (``target``, ``shard_index``, ``heads`` [start, end) added).
    ``instance_id`` joins the shards' ids with ``,``; ``instance_ids`` lists them.
    """

    shard_results: list[PrefillResult] = dataclasses.field(default_factory=list)
    instance_ids: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------- pure helpers


def _weights_base(source: str) -> str:
    """``random(seed=3) [heads 0:2 of 4]`` -> ``random(seed=3)``."""
    i = source.find(" [heads ")
    return source[:i] if i >= 0 else source


def check_layout(targets: list[str], infos: list[ServerInfo]) -> list[int]:
    """Validate that ``infos`` (one per target) form one head-sharded model; returns the
    target indices in head order. Raises :class:`ShardLayoutError` naming the field."""
    if not infos:
        raise ShardLayoutError("no shard targets")
    ref = infos[0]
    for t, info in zip(targets, infos, strict=True):
        for f in SAME_FIELDS:
            a, b = getattr(ref, f), getattr(info, f)
            if a != b:
                raise ShardLayoutError(f"shard {t} has {f}={b!r}, shard {targets[0]} has {a!r}")
    if ref.num_shards != len(infos):
        raise ShardLayoutError(
            f"the workers are shards of a model split {ref.num_shards} ways, {len(infos)} targets given"
        )
    order = sorted(range(len(infos)), key=lambda i: infos[i].head_start)
    at = 0
    for i in order:
        info = infos[i]
        if info.head_start != at:
            what = (f"overlapping heads below {at} already served" if info.head_start < at
                    else f"no shard serves heads [{at}, {info.head_start})")
            raise ShardLayoutError(
                f"shards do not tile heads [0, {ref.total_heads}): {targets[i]} serves "
                f"[{info.head_start}, {info.head_end}), {what}"
            )
        at = info.head_end
    if at != ref.total_heads:
        raise ShardLayoutError(f"shards cover heads [0, {at}), the model has {ref.total_heads}")
    bases = {_weights_base(info.weights_source) for info in infos}
    if any(b.startswith("random(") for b in bases) and len(bases) > 1:
        raise ShardLayoutError(f"shards run different random weights: {sorted(bases)}")
    return order


def split_q(q: Any, total_heads: int, head_ranges: list[tuple[int, int]], prefill_dtype: str,
            q_dtype: int | None = None) -> list[tuple[Any, int | None]]:
    """``q`` ``[Tq, H_total, D]`` -> per shard ``(its heads, q_dtype to send)``: views of one
    array of wire bits.

    Floats are rounded once (bf16, or fp8 for an fp8-prefill model; ``q_dtype`` forces
    BF16/FP8_E4M3); ``uint16``/``uint8`` arrays are bf16/fp8 bits; a ``RawTensor`` is
    sliced as is. The slices are views: the only copy left is the one the codec makes
    when it serializes each shard's message.
    """
    if isinstance(q, RawTensor):
        raw = q
    else:
        arr = np.asarray(q)
        if q_dtype is None:
            if arr.dtype == np.uint16:
                q_dtype = BF16
            elif arr.dtype == np.uint8:
                q_dtype = FP8_E4M3
            else:
                q_dtype = FP8_E4M3 if prefill_dtype == "fp8" else BF16
        if q_dtype == BF16:
            bits = arr if arr.dtype == np.uint16 else float32_to_bf16_bits(arr)
        elif q_dtype == FP8_E4M3:
            bits = arr if arr.dtype == np.uint8 else float32_to_fp8_e4m3_bits(arr)
        else:  # another wire dtype (the server judges it): slice the array as it is
            _check_q_shape(arr.shape, total_heads)
            return [(arr[:, a:b], q_dtype) for a, b in head_ranges]
        raw = RawTensor(q_dtype, bits)
    _check_q_shape(raw.bits.shape, total_heads)
    return [(RawTensor(raw.dtype, raw.bits[:, a:b]), None) for a, b in head_ranges]


def _check_q_shape(shape: tuple[int, ...], total_heads: int) -> None:
    if len(shape) != 3 or shape[1] != total_heads:
        raise ValueError(f"q: shape {list(shape)} is not [Tq, {total_heads}, P+R] (the model's heads)")


def _one_count(written: list[int], targets: list[str]) -> int:
    """The slots every shard wrote (``written`` and ``targets`` in head order), or
    CtxPrefillError naming each shard's count where they differ."""
    if len(set(written)) != 1:
        raise CtxPrefillError(f"shards wrote different numbers of slots: {dict(zip(targets, written, strict=True))}")
    return written[0]


def _same_bytes(reads: list[np.ndarray], targets: list[str]) -> None:
    """ShardedReadMismatchError naming the first shard whose bytes differ from the first
    shard's (``reads`` and ``targets`` in head order)."""
    for t, r in zip(targets[1:], reads[1:], strict=True):
        if not np.array_equal(r, reads[0]):
            raise ShardedReadMismatchError(f"shard {t} holds other bytes than shard {targets[0]}")


def _shared_workspace(infos: list[ServerInfo], workspace_tokens: int | None) -> int | None:
    """The workspace every shard plans with: the caller's, else the smallest default where
    the shards' defaults differ (so that they plan the same chunks)."""
    if workspace_tokens is None and len({i.workspace_tokens for i in infos}) > 1:
        return min(i.workspace_tokens for i in infos)
    return workspace_tokens


def concat_results(results: list[PrefillResult], targets: list[str], infos: list[ServerInfo]) -> ShardedPrefillResult:
    """Shard results in head order -> one result of the whole model."""
    output = np.concatenate([r.output for r in results], axis=1)
    bits = None
    if all(r.output_bits is not None for r in results):
        bits = np.concatenate([r.output_bits for r in results], axis=1)
    lse = np.concatenate([r.lse for r in results], axis=0)
    s0 = results[0].stats
    for t, r in zip(targets[1:], results[1:], strict=True):
        for key in ("chunks", "path", "fp8_path", "context_tokens", "query_tokens"):
            if r.stats[key] != s0[key]:
                raise CtxPrefillError(f"shard {t} reports {key}={r.stats[key]!r}, shard {targets[0]} {s0[key]!r}")
    launches: dict[str, int] = {}
    stage: dict[str, int] = {}
    for r in results:
        for k, v in r.stats["kernel_launches"].items():
            launches[k] = launches.get(k, 0) + int(v)
        for k, v in r.stats["stage_nanos"].items():
            stage[k] = max(stage.get(k, 0), int(v))
    shards = []
    for t, info, r in zip(targets, infos, results, strict=True):
        shards.append({**r.stats, "target": t, "shard_index": info.shard_index,
                       "heads": (info.head_start, info.head_end), "instance_id": r.instance_id})
    stats = {
        **s0,
        "kernel_launches": launches,
        "stage_nanos": stage,
        "total_nanos": max(int(r.stats["total_nanos"]) for r in results),
        # the slowest shard's, so that the parts add up to total_nanos
        "phase_nanos": max(results, key=lambda r: int(r.stats["total_nanos"])).stats["phase_nanos"],
        "shards": shards,
    }
    ids = [r.instance_id for r in results]
    # every shard holds the whole cache: a cache_write writes the same slots in each
    written = _one_count([r.slots_written for r in results], targets)
    return ShardedPrefillResult(
        output=output, output_bits=bits, lse=lse, stats=stats, instance_id=",".join(ids),
        request_id=results[0].request_id, raw=None, shard_results=list(results), instance_ids=ids,
        slots_written=written,
    )


def _annotate(err: BaseException, target: str, info: ServerInfo | None, position: int) -> BaseException:
    err.shard_target = target  # type: ignore[attr-defined]
    err.shard_index = info.shard_index if info is not None else position  # type: ignore[attr-defined]
    if hasattr(err, "add_note"):
        err.add_note(f"(on shard {err.shard_index}, {target})")  # type: ignore[attr-defined]
    return err


def _info_of(layout: tuple[list[ServerInfo], list[int]] | None, target: int) -> ServerInfo | None:
    """The ServerInfo of target index ``target``, once the layout is known."""
    return None if layout is None else layout[0][layout[1].index(target)]


def _materialize(sequences: Iterable[Any]) -> list[Any]:
    return sequences if isinstance(sequences, list) else list(sequences)


# --------------------------------------------------------------------------- sync client


class ShardedPrefillClient:
    """One model, its heads served by ``len(targets)`` workers (sync, thread pool).

    ``targets`` in any order (the layout comes from each worker's GetServerInfo);
    ``client_kwargs`` go to every shard's :class:`PrefillContextClient` (timeout,
    retries, TLS, token, ...). ``expected_instance_ids``: one per target (else each
    shard's first answer sets it). Thread-safe for concurrent calls.
    """

    def __init__(self, targets: list[str], *, expected_instance_ids: list[str | None] | None = None,
                 max_workers: int | None = None, **client_kwargs: Any) -> None:
        if not targets:
            raise ValueError("ShardedPrefillClient needs at least one target")
        if "expected_instance_id" in client_kwargs:
            raise TypeError("pass expected_instance_ids=[...] (one per target), not expected_instance_id")
        ids = expected_instance_ids or [None] * len(targets)
        if len(ids) != len(targets):
            raise ValueError(f"{len(ids)} expected_instance_ids for {len(targets)} targets")
        self.targets = list(targets)
        self.clients = [PrefillContextClient(t, expected_instance_id=i, **client_kwargs)
                        for t, i in zip(targets, ids, strict=True)]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers or 2 * len(targets), thread_name_prefix="ctxprefill-shard")
        # (infos in head order, head order -> index into targets), from the first server_info()
        self._layout: tuple[list[ServerInfo], list[int]] | None = None

    # ------------------------------------------------------------------ plumbing

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> ShardedPrefillClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _all(self, fn: Callable[[int], _T], indices: list[int]) -> list[_T]:
        """fn(i) for each target index, concurrently; the first failure (in the given
        order) is raised, annotated with its shard, after all have finished."""
        futures = [self._pool.submit(fn, i) for i in indices]
        concurrent.futures.wait(futures)
        for i, f in zip(indices, futures, strict=True):
            e = f.exception()
            if e is not None:
                raise _annotate(e, self.targets[i], _info_of(self._layout, i), i)
        return [f.result() for f in futures]

    def _shards(self) -> tuple[list[ServerInfo], list[int]]:
        if self._layout is None:
            self.server_info()
        assert self._layout is not None
        return self._layout

    @property
    def infos(self) -> list[ServerInfo]:
        """The shards' ServerInfo in head order (discovered on first use)."""
        return self._shards()[0]

    @property
    def shard_targets(self) -> list[str]:
        """The targets in head order."""
        return [self.targets[i] for i in self._shards()[1]]

    @property
    def total_heads(self) -> int:
        return self.infos[0].total_heads

    @property
    def head_ranges(self) -> list[tuple[int, int]]:
        return [(i.head_start, i.head_end) for i in self.infos]

    @property
    def instance_ids(self) -> list[str | None]:
        """The instance each shard's client expects, in the order of ``targets``."""
        return [c.instance_id for c in self.clients]

    def reset_instance(self, shard: int | None = None) -> None:
        """Forget the remembered instance of one target (index into ``targets``) or of all,
        after re-populating a restarted shard's cache."""
        for i, c in enumerate(self.clients):
            if shard is None or i == shard:
                c.reset_instance()
        self._layout = None

    # ------------------------------------------------------------------ RPCs

    def server_info(self, *, timeout: float | None = None) -> list[ServerInfo]:
        """GetServerInfo of every shard; checks the layout; returns the infos in head order."""
        idx = list(range(len(self.targets)))
        infos = self._all(lambda i: self.clients[i].server_info(timeout=timeout), idx)
        order = check_layout(self.targets, infos)
        self._layout = ([infos[i] for i in order], order)
        return self._layout[0]

    def write_cache(self, slot_mapping: Any, kv_c: Any, k_pe: Any, *, timeout: float | None = None,
                    layer: int | None = None) -> int:
        """The same latents to every shard (concurrently); returns the slots written (checked equal)."""
        _, order = self._shards()
        n = self._all(lambda i: self.clients[i].write_cache(slot_mapping, kv_c, k_pe, timeout=timeout, layer=layer),
                      order)
        return _one_count(n, self.shard_targets)

    def read_cache(self, slot_mapping: Any, *, verify: bool = False, shard: int = 0,
                   timeout: float | None = None, layer: int | None = None) -> np.ndarray:
        """ReadCache from shard ``shard`` (head order); ``verify=True`` reads every shard and
        raises :class:`ShardedReadMismatchError` unless all hold the same bytes."""
        infos, order = self._shards()
        if not verify:
            i = order[shard]
            try:
                return self.clients[i].read_cache(slot_mapping, timeout=timeout, layer=layer)
            except Exception as e:
                raise _annotate(e, self.targets[i], infos[shard], i) from None
        res = self._all(lambda i: self.clients[i].read_cache(slot_mapping, timeout=timeout, layer=layer), order)
        _same_bytes(res, self.shard_targets)
        return res[shard]

    def prefill_context(
        self,
        q: Any,
        sequences: Iterable[Any],
        *,
        request_id: str | None = None,
        workspace_tokens: int | None = None,
        plan: Iterable[Any] | None = None,
        q_dtype: int | None = None,
        timeout: float | None = None,
        layer: int | None = None,
        cache_write: Any = None,
    ) -> ShardedPrefillResult:
        """PrefillContext of the whole model: ``q`` ``[Tq, H_total, P+R]`` split by heads, every
        shard run concurrently, ``output``/``lse`` concatenated along heads. Arguments as
        ``PrefillContextClient.prefill_context``. Shards of different default workspaces
        all get the smallest, so that they plan the same chunks."""
        infos, order = self._shards()
        seqs = _materialize(sequences)
        plan = None if plan is None else _materialize(plan)
        workspace_tokens = _shared_workspace(infos, workspace_tokens)
        parts = split_q(q, infos[0].total_heads, self.head_ranges, infos[0].prefill_dtype, q_dtype)

        def one(k: int) -> PrefillResult:
            part, qd = parts[k]
            return self.clients[order[k]].prefill_context(
                part, seqs, request_id=request_id, workspace_tokens=workspace_tokens, plan=plan, q_dtype=qd,
                timeout=timeout, layer=layer, cache_write=cache_write)

        futures = [self._pool.submit(one, k) for k in range(len(order))]
        concurrent.futures.wait(futures)
        for k, f in enumerate(futures):
            e = f.exception()
            if e is not None:
                raise _annotate(e, self.targets[order[k]], infos[k], order[k])
        return concat_results([f.result() for f in futures], self.shard_targets, infos)


# --------------------------------------------------------------------------- asyncio client


class AsyncShardedPrefillClient:
    """The asyncio twin of :class:`ShardedPrefillClient` (``asyncio.gather`` over
    :class:`AsyncPrefillContextClient`); create it inside the running event loop."""

    def __init__(self, targets: list[str], *, expected_instance_ids: list[str | None] | None = None,
                 **client_kwargs: Any) -> None:
        if not targets:
            raise ValueError("AsyncShardedPrefillClient needs at least one target")
        if "expected_instance_id" in client_kwargs:
            raise TypeError("pass expected_instance_ids=[...] (one per target), not expected_instance_id")
        ids = expected_instance_ids or [None] * len(targets)
        if len(ids) != len(targets):
            raise ValueError(f"{len(ids)} expected_instance_ids for {len(targets)} targets")
        self.targets = list(targets)
        self.clients = [AsyncPrefillContextClient(t, expected_instance_id=i, **client_kwargs)
                        for t, i in zip(targets, ids, strict=True)]
        self._layout: tuple[list[ServerInfo], list[int]] | None = None  # as ShardedPrefillClient's

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))

    async def __aenter__(self) -> AsyncShardedPrefillClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _all(self, fn: Callable[[int], Awaitable[_T]], indices: list[int]) -> list[_T]:
        res = await asyncio.gather(*(fn(i) for i in indices), return_exceptions=True)
        out: list[_T] = []
        for i, r in zip(indices, res, strict=True):
            if isinstance(r, BaseException):
                raise _annotate(r, self.targets[i], _info_of(self._layout, i), i)
            out.append(r)
        return out

    async def _shards(self) -> tuple[list[ServerInfo], list[int]]:
        if self._layout is None:
            await self.server_info()
        assert self._layout is not None
        return self._layout

    @property
    def instance_ids(self) -> list[str | None]:
        return [c.instance_id for c in self.clients]

    def reset_instance(self, shard: int | None = None) -> None:
        for i, c in enumerate(self.clients):
            if shard is None or i == shard:
                c.reset_instance()
        self._layout = None

    async def server_info(self, *, timeout: float | None = None) -> list[ServerInfo]:
        infos = await self._all(lambda i: self.clients[i].server_info(timeout=timeout), list(range(len(self.targets))))
        order = check_layout(self.targets, infos)
        self._layout = ([infos[i] for i in order], order)
        return self._layout[0]

    async def write_cache(self, slot_mapping: Any, kv_c: Any, k_pe: Any, *, timeout: float | None = None,
                          layer: int | None = None) -> int:
        _, order = await self._shards()
        n = await self._all(lambda i: self.clients[i].write_cache(slot_mapping, kv_c, k_pe, timeout=timeout,
                                                                  layer=layer), order)
        return _one_count(n, [self.targets[i] for i in order])

    async def read_cache(self, slot_mapping: Any, *, verify: bool = False, shard: int = 0,
                         timeout: float | None = None, layer: int | None = None) -> np.ndarray:
        _, order = await self._shards()
        read = order if verify else [order[shard]]
        res = await self._all(lambda i: self.clients[i].read_cache(slot_mapping, timeout=timeout, layer=layer), read)
        if verify:
            _same_bytes(res, [self.targets[i] for i in order])
            return res[shard]
        return res[0]

    async def prefill_context(
        self,
        q: Any,
        sequences: Iterable[Any],
        *,
        request_id: str | None = None,
        workspace_tokens: int | None = None,
        plan: Iterable[Any] | None = None,
        q_dtype: int | None = None,
        timeout: float | None = None,
        layer: int | None = None,
        cache_write: Any = None,
    ) -> ShardedPrefillResult:
        infos, order = await self._shards()
        seqs = _materialize(sequences)
        plan = None if plan is None else _materialize(plan)
        workspace_tokens = _shared_workspace(infos, workspace_tokens)
        ranges = [(i.head_start, i.head_end) for i in infos]
        parts = split_q(q, infos[0].total_heads, ranges, infos[0].prefill_dtype, q_dtype)
        res = await asyncio.gather(
            *(self.clients[order[k]].prefill_context(part, seqs, request_id=request_id,
                                                    workspace_tokens=workspace_tokens, plan=plan, q_dtype=qd,
                                                    timeout=timeout, layer=layer, cache_write=cache_write)
              for k, (part, qd) in enumerate(parts)),
            return_exceptions=True)
        results: list[PrefillResult] = []
        for k, r in enumerate(res):
            if isinstance(r, BaseException):
                raise _annotate(r, self.targets[order[k]], infos[k], order[k])
            results.append(r)
        return concat_results(results, [self.targets[i] for i in order], infos)
