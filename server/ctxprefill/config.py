"""Validated settings: model shape, cache, dtypes, workspace (CONTRACT §1, §2, §5).

Everything is checked here, up front, so that a server that cannot serve correctly
refuses to start with a message naming the setting, instead of failing per request.
"""

from __future__ import annotations

import dataclasses
import math

from .errors import ConfigError, InvalidArgument, OutOfRange
from .ops.kv_b_proj import GEMMS
from .ops.slot_format import CACHE_DTYPES, bytes_per_slot

KV_B_PROJ_DTYPES = ("bf16", "fp8")
#: model layers a server may hold (DeepSeek-V3 has 61, Kimi K2 61)
MAX_LAYERS = 1024
PREFILL_DTYPES = ("bf16", "fp8")
#: default --max-context-token-heads: 1 Mi context tokens over 128 heads (DeepSeek-V3's all)
MAX_CONTEXT_TOKEN_HEADS = 1 << 27


def check_layers(num_layers, first_layer) -> None:
    """``--layers`` and ``--first-layer`` (ConfigError naming the flag)."""
    if not isinstance(num_layers, int) or not 1 <= num_layers <= MAX_LAYERS:
        raise ConfigError(f"--layers must be an integer in [1, {MAX_LAYERS}], got {num_layers!r}")
    if not isinstance(first_layer, int) or not 0 <= first_layer <= MAX_LAYERS - num_layers:
        raise ConfigError(f"--first-layer must be an integer in [0, {MAX_LAYERS} - --layers], got {first_layer!r}")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """MLA dimensions of one worker. The kernels are built for DeepSeek-V3's L/P/R/V;
    only the head count varies (a tensor-parallel rank holds 128 / tp heads)."""

    heads: int = 16
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    softmax_scale: float | None = None  # default (P+R) ** -0.5

    def __post_init__(self):
        if not isinstance(self.heads, int) or self.heads < 1:
            raise ConfigError(f"--heads must be an integer >= 1, got {self.heads!r}")
        dims = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if dims != (512, 128, 64, 128):
            raise ConfigError(f"only L=512, P=128, R=64, V=128 (DeepSeek-V3 / Kimi MLA) are supported, got {dims}")
        s = self.softmax_scale
        if s is not None and not (math.isfinite(s) and s > 0):
            raise ConfigError(f"softmax scale must be finite and > 0, got {s!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.qk_head_dim**-0.5


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    dtype: str = "auto"
    block_size: int = 64
    num_blocks: int = 1024
    k_scale: float = 1.0

    def __post_init__(self):
        if self.dtype not in CACHE_DTYPES:
            raise ConfigError(f"--cache-dtype must be one of {', '.join(CACHE_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"--block-size must be an integer >= 1, got {self.block_size!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.num_blocks * self.block_size >= 2**31:
            raise ConfigError("--num-blocks × --block-size must stay below 2**31 slots")
        if not (math.isfinite(self.k_scale) and self.k_scale > 0):
            raise ConfigError(f"--k-scale must be finite and > 0, got {self.k_scale!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_slot(self) -> int:
        return bytes_per_slot(self.dtype)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    shape: ModelShape = dataclasses.field(default_factory=ModelShape)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    kv_b_proj_dtype: str = "bf16"  # taken from the weights
    prefill_dtype: str = "bf16"
    workspace_tokens: int = 65536
    fused: bool = True  # fused pack kernels (False: the generic path)
    # fused path, bf16 prefill: attention reads k_nope and k_pe where they lie, no K pack,
    # when the backend reads the keys unpacked (False: the fused pack kernel packs K)
    unpacked_keys: bool = True
    backend: str = "auto"
    num_layers: int = 1  # model layers held, each with its own cache and kv_b_proj
    first_layer: int = 0  # model index of the first of them
    # one request's context tokens x heads served at most (its gather and kv_b_proj work)
    max_context_token_heads: int = MAX_CONTEXT_TOKEN_HEADS
    # on a GPU: a request shape's chunk loop replayed as a CUDA graph from its third request on
    cuda_graphs: bool = False
    # kv_b_proj's bf16 GEMM on a Hopper GPU (ops.kv_b_proj.GEMMS)
    kv_b_proj_gemm: str = "cublas"

    def __post_init__(self):
        check_layers(self.num_layers, self.first_layer)
        m = self.max_context_token_heads
        if not isinstance(m, int) or m < self.shape.heads * self.cache.block_size:
            raise ConfigError(f"--max-context-token-heads must be an integer >= one block over the heads "
                              f"({self.shape.heads * self.cache.block_size}), got {m!r}")
        if self.kv_b_proj_dtype not in KV_B_PROJ_DTYPES:
            raise ConfigError(f"kv_b_proj dtype must be one of {KV_B_PROJ_DTYPES}, got {self.kv_b_proj_dtype!r}")
        if self.kv_b_proj_gemm not in GEMMS:
            raise ConfigError(f"kv_b_proj GEMM must be one of {GEMMS}, got {self.kv_b_proj_gemm!r}")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ConfigError(f"--prefill-dtype must be one of {', '.join(PREFILL_DTYPES)}, got {self.prefill_dtype!r}")
        if not isinstance(self.workspace_tokens, int) or self.workspace_tokens < self.cache.block_size:
            raise ConfigError(
                f"--workspace-tokens must be at least one block ({self.cache.block_size}), "
                f"got {self.workspace_tokens!r}"
            )
        if self.prefill_dtype == "fp8" and self.cache.dtype == "fp8" and self.cache.k_scale != 1.0:
            raise ConfigError(
                f"--prefill-dtype fp8 on an fp8 cache copies the cache's raw fp8 bytes into attention, which is "
                f"exact only with --k-scale 1.0 (got {self.cache.k_scale}); use --k-scale 1.0, --cache-dtype "
                f"fp8_ds_mla, or --prefill-dtype bf16"
            )

    @property
    def layers(self) -> range:
        """The model indices of the layers held."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    def layer_position(self, layer: int | None) -> int:
        """Where model layer ``layer`` is among the layers held (0 for the first); None
        names a one-layer server's only layer. OutOfRange / InvalidArgument naming ``layer``."""
        first, n = self.first_layer, self.num_layers
        if layer is None:
            if n > 1:
                raise InvalidArgument("layer", f"this server holds {n} layers, [{first}, {first + n}): name one")
            return 0
        if not first <= layer < first + n:
            raise OutOfRange("layer", f"layer {layer} is not held here: this server holds [{first}, {first + n})")
        return layer - first

    @property
    def gather_raw_fp8(self) -> bool:
        """Plain fp8 cache + fp8 prefill: the workspace holds the cache's fp8 bytes as they are."""
        return self.cache.dtype == "fp8" and self.prefill_dtype == "fp8"

    @property
    def fp8_path_labels(self) -> dict[str, str]:
        return {"cache_dtype": self.cache.dtype, "kv_b_proj_dtype": self.kv_b_proj_dtype,
                "prefill_dtype": self.prefill_dtype}
