"""Server settings (CONTRACT §8): one typed object built from flags or the environment,
and its checks (ConfigError naming the flag). The engine and the server it describes are
built by the composition root (``ctxprefill.app``).

Every flag ``--some-flag`` can also be set as ``CTXPREFILL_SOME_FLAG``; a flag given
on the command line wins over the environment. The value goes through the flag's own type
and choices (a boolean: 1/0, true/false, yes/no, on/off); argparse refuses a bad one,
naming the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from .backends import registry
from .checkpoint import MODEL_FIELDS, resolve_model
from .config import KV_B_PROJ_DTYPES, MAX_CONTEXT_TOKEN_HEADS, PREFILL_DTYPES, CacheConfig, EngineConfig, ModelShape
from .engine.loop import STOP_AHEAD
from .engine.request import q_dtype
from .errors import ConfigError
from .ops.kv_b_proj import GEMMS, PAGED_MAX_N
from .ops.slot_format import CACHE_DTYPES

log = logging.getLogger("ctxprefill")

#: heads a worker may serve for "paged" to read the cache: its weight (P + V rows a head)
#: narrower than PAGED_MAX_N
_PAGED_MAX_HEADS = PAGED_MAX_N // (ModelShape().qk_nope_head_dim + ModelShape().v_head_dim)


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"  # loopback only unless a credential (or --allow-insecure) says otherwise
    port: int = 50051
    metrics_host: str = ""  # "": the same as host
    unix_socket: str | None = None  # also serve gRPC on this unix-domain socket (same-host callers)
    metrics_port: int = 9400
    allow_insecure: bool = False  # listen beyond loopback without credentials (or with a token over plaintext)
    device: str = "auto"
    heads: int = 16
    shard_index: int = 0  # this worker's head shard (tensor parallelism over heads)
    num_shards: int = 1  # head shards of the model; > 1: --heads is the model's total
    layers: int = 1  # model layers held, each with its own cache and kv_b_proj
    first_layer: int = 0  # model index of the first layer held
    block_size: int = 64
    num_blocks: int = 4096
    cache_dtype: str = "auto"
    k_scale: float = 1.0
    prefill_dtype: str = "bf16"
    backend: str = "auto"
    workspace_tokens: int = 65536
    weights: str | None = None
    weights_prefix: str = ""
    model: str | None = None  # a Hugging Face checkpoint directory (DeepSeek-V2/V3 architecture)
    seed: int = 0
    kv_b_proj_dtype: str = "bf16"  # random weights only; a file decides its own
    generic: bool = False  # run the generic (unfused) pack path
    unpacked_keys: bool = True  # fused bf16 prefill: no K pack where the attention backend reads the keys unpacked
    cuda_graphs: bool = False  # replay a request shape's chunk loop as a CUDA graph (engine/graphs.py)
    kv_b_proj_gemm: str = "cublas"  # kv_b_proj's bf16 GEMM on a Hopper GPU (ops/kv_b_proj.py)
    softmax_scale: float | None = None
    grace_seconds: float = 25.0  # SIGTERM: how long in-flight requests may take to finish
    max_message_bytes: int = 1 << 30  # gRPC send/receive limit
    max_inflight_bytes: int = 4 << 30  # messages being read, requests held and answers being sent, all calls
    max_answer_bytes: int = 256 << 20  # tensor bytes one answer may carry (capped by max_message_bytes)
    receive_timeout_s: float = 60.0  # a unary request's message must be in within this
    send_timeout_s: float = 60.0  # an answer not taken by its client within this closes the client's connection
    keepalive_time_s: float = 60.0  # the server pings each connection this often (HTTP/2 PING)
    keepalive_timeout_s: float = 20.0  # a ping not acknowledged within this closes its connection
    queue_size: int = 64  # requests admitted at once (running + waiting); more get RESOURCE_EXHAUSTED
    max_context_token_heads: int = MAX_CONTEXT_TOKEN_HEADS  # one request's context tokens x heads, at most
    tls_cert: str | None = None  # PEM certificate chain of the gRPC port (TLS on when set)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: require and verify client certificates (mutual TLS)
    auth_token_file: str | None = None  # file holding the bearer token every RPC must carry
    shared_memory: str = "off"  # same-host transport (docs/TRANSPORT.md): off, system, cuda or all
    shared_memory_max_regions: int = 64  # shared-memory regions registered at once
    shared_memory_max_bytes: int = 64 << 30  # bytes in all registered regions together
    shared_memory_pin: bool = True  # page-lock system regions on a CUDA server (DMA instead of staging)
    request_ring: bool = False  # same-host request rings (docs/TRANSPORT.md); needs system shared memory
    request_ring_max: int = 16  # request rings attached at once
    request_ring_spin_us: int = 20000  # after a ring request, the engine thread polls without sleeping this long
    request_ring_poll_us: int = 100  # then it checks the rings this often
    request_ring_overlap: bool = True  # start the next ring request before answering the previous one
    request_overlap: bool = True  # start the next queued PrefillContext request before finishing the previous one
    request_ring_stream_order: bool = False  # rings may order requests on the device by CUDA IPC events
    request_ring_stream_order_timeout_s: float = 30.0  # a stream-ordered request unfinished this long: ring detached
    otlp_endpoint: str | None = None  # OpenTelemetry traces to this OTLP/gRPC collector (service/tracing.py)


_HELP = {
    "host": "address to bind the gRPC server to; any address but loopback needs a bearer token over TLS or mutual "
            "TLS, or --allow-insecure",
    "port": "gRPC port",
    "unix_socket": "also serve gRPC on this unix-domain socket path (same credentials and token as --port): callers "
                   "on this host, e.g. other containers that mount it; shared memory is served to such callers and "
                   "to loopback ones only; the socket file's permissions decide who can connect",
    "metrics_host": "address to bind the HTTP server (/metrics, /healthz, /readyz) to; empty: --host's",
    "metrics_port": "HTTP port for /metrics, /healthz and /readyz",
    "allow_insecure": "allow listening beyond loopback with no credentials, or with a bearer token over plaintext: "
                      "anyone who reaches the gRPC port then reads and overwrites every cache slot",
    "device": "auto (cuda if present, else cpu), cpu, cuda or cuda:N",
    "heads": "attention heads on this worker (128 / tensor-parallel size); with --num-shards > 1 the model's "
             "total heads, of which this worker serves its shard",
    "shard_index": "which head shard this worker serves: heads [I*H/N, (I+1)*H/N) of --heads H (0 <= I < N)",
    "num_shards": "head shards N of the model (one worker each, same cache contents); 1: unsharded",
    "layers": "model layers this server holds, each with its own cache of --num-blocks blocks and its own "
              "kv_b_proj (a request names its layer); with --weights, --weights-prefix must contain {layer}",
    "first_layer": "model index of the first layer held: the server holds layers [F, F + --layers)",
    "block_size": "tokens per cache block",
    "num_blocks": "cache blocks",
    "cache_dtype": "auto (bf16), fp8 or fp8_ds_mla",
    "k_scale": "per-tensor scale of the fp8 cache",
    "prefill_dtype": "bf16 or fp8 (q arrives in fp8; k, v quantized)",
    "backend": "attention backend: auto (on a GPU: gluon on Hopper, else triton, unless cudnn-frontend, timed "
               "against it at start-up on a workspace-sized chunk, is 10%% faster), gluon, triton, cudnn-frontend, "
               "cudnn or reference (ctxprefill.backends.registry)",
    "workspace_tokens": "rows of the gather workspace (the largest chunk)",
    "weights": "safetensors file holding {prefix}kv_b_proj.weight (random weights when absent)",
    "weights_prefix": "key prefix in the weights file, e.g. model.layers.0.self_attn.; {layer} in it stands for "
                      "each layer's model index (model.layers.{layer}.self_attn.)",
    "model": "Hugging Face checkpoint directory of a DeepSeek-V2/V3-architecture model (config.json, safetensors "
             "shards): heads, layers, softmax scale and each layer's kv_b_proj come from it; --heads, --layers, "
             "--first-layer, --softmax-scale given explicitly override its config.json",
    "seed": "seed of the random weights used when --weights is not given (model layer i gets seed + i)",
    "kv_b_proj_dtype": "dtype of random weights (bf16 or fp8); a weights file decides its own",
    "generic": "use the generic (unfused) pack path instead of the fused kernels",
    "unpacked_keys": "fused path, bf16 prefill, with an attention backend that reads the keys unpacked (gluon, "
                     "triton): pack no K, attention reads k_nope from the kv_b_proj output and k_pe from the "
                     "workspace (same bits; docs/DESIGN.md); --no-unpacked-keys packs K = [k_nope | k_pe] with the "
                     "fused kernel every chunk",
    "cuda_graphs": "on a GPU, replay a request shape's chunk loop as a CUDA graph from the shape's third request on "
                   "(the same kernels and bits, one launch; captured at its second, at most 8 shapes kept): the host "
                   "still checks, plans and copies each request in; requests with a trace timeline, or a deadline "
                   f"over more than {STOP_AHEAD} chunks, run eagerly; per-stage times become one 'graph' stage",
    "kv_b_proj_gemm": "kv_b_proj's bf16 GEMM on a Hopper GPU: cublas; gluon (the persistent warp-specialized "
                      "kernel); or paged: that kernel reading each chunk's latents from the cache where they lie, "
                      "the chunk's gather folded into it, with a bf16 cache, a block size that is a multiple of 64, "
                      f"fewer than {_PAGED_MAX_HEADS} heads and a chunk of one sequence starting on a 64-token "
                      "page (cuBLAS elsewhere). The same results; with --cuda-graphs, paged saves ~3 %% of a 16-head "
                      "request's device time (docs/DESIGN.md)",
    "softmax_scale": "softmax scale (default (P+R)**-0.5; pass the final one, yarn mscale included)",
    "grace_seconds": "on SIGTERM/SIGINT: seconds in-flight requests get to finish before the server exits",
    "max_message_bytes": "largest gRPC message the server receives or sends, in bytes",
    "max_inflight_bytes": "bytes that all calls together may hold: each message being read reserves "
                          "--max-message-bytes until it is in, then holds its size until it is answered; each answer "
                          "holds twice its size until the client has taken it. Over it: RESOURCE_EXHAUSTED (a read "
                          "first waits its turn, for --receive-timeout-s or the call's deadline at most)",
    "max_answer_bytes": "largest tensor data one answer carries (ReadCache's slots, PrefillContext's inline output "
                        "and LSE), in bytes, capped by --max-message-bytes; a request for more is refused with "
                        "RESOURCE_EXHAUSTED before anything is allocated",
    "receive_timeout_s": "seconds a unary request's message has to arrive once the server reads it "
                         "(DEADLINE_EXCEEDED after)",
    "send_timeout_s": "seconds an answer may wait for its client to take it once it is handed to gRPC (a stream's, "
                      "each answer): then the client's connection is closed, every call on it ends and the memory "
                      "their answers held is given back (unix-socket connections: keepalive only)",
    "keepalive_time_s": "seconds between the server's HTTP/2 keepalive pings on each connection, with or without "
                        "calls; a peer that stops reading the connection stops acknowledging them",
    "keepalive_timeout_s": "seconds a keepalive ping may wait for its acknowledgement (also the connection's "
                           "TCP_USER_TIMEOUT): then the connection is closed, its calls end and the memory their "
                           "answers held (--max-inflight-bytes) is given back",
    "queue_size": "requests admitted at once (the running one and those waiting for the device); "
                  "more are refused with RESOURCE_EXHAUSTED",
    "max_context_token_heads": "the work one PrefillContext may ask for: its context tokens (summed over its "
                               "sequences) times the heads this worker serves; more is refused up front with "
                               "RESOURCE_EXHAUSTED naming the figure (2**27: 1 Mi tokens over 128 heads)",
    "tls_cert": "PEM certificate (chain) of the gRPC port; with --tls-key, the port speaks TLS only",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: require a client certificate signed by it (mutual TLS; needs --tls-cert)",
    "auth_token_file": "file holding a bearer token: every RPC but grpc.health.v1 must send "
                       "'authorization: Bearer <token>' (or set the token itself in CTXPREFILL_AUTH_TOKEN)",
    "shared_memory": "same-host tensor transport (docs/TRANSPORT.md): off, system (POSIX shared memory), cuda "
                     "(CUDA IPC handles; needs a CUDA device) or all (system, and cuda on a CUDA device); served to "
                     "loopback and --unix-socket callers only; any local process that can open a registered segment "
                     "can read and change what flows through it",
    "shared_memory_max_regions": "shared-memory regions registered at once (more: RESOURCE_EXHAUSTED)",
    "shared_memory_max_bytes": "bytes of all registered shared-memory regions together (more: RESOURCE_EXHAUSTED)",
    "shared_memory_pin": "on a CUDA server, page-lock each system region when it is registered (cudaHostRegister), "
                         "so that q and the results move by DMA; --no-shared-memory-pin leaves them pageable "
                         "(staged by CUDA; no locked memory)",
    "request_ring": "allow request rings (AttachRequestRing): PrefillContext requests through shared-memory slots "
                    "that the engine thread polls, no gRPC call per request; needs --shared-memory system or all. The "
                    "engine thread then spins for --request-ring-spin-us after each ring request (one CPU busy)",
    "request_ring_max": "request rings attached at once (more: RESOURCE_EXHAUSTED)",
    "request_ring_spin_us": "after a ring request, how long the engine thread polls the rings without sleeping "
                            "(microseconds); a request arriving within it is taken at once",
    "request_ring_poll_us": "otherwise, how often the engine thread checks the rings (microseconds)",
    "request_ring_overlap": "start the next waiting ring request (validate it, queue its device work) before the "
                            "previous one is waited for and answered, so that the device goes from one request to "
                            "the next; --no-request-ring-overlap runs each to its answer first (the baseline of "
                            "bench/bench_concurrency.py's A/B)",
    "request_overlap": "start the next queued PrefillContext request (a call's or a stream's) before the previous "
                       "one is waited for and answered, where its start need not wait for the device (a GPU, q in "
                       f"a CUDA region, no cache_write, at most {STOP_AHEAD} chunks), so that the device goes from one "
                       "request's work to the next; --no-request-overlap answers each before the next starts (the "
                       "baseline of bench/bench_concurrency.py's A/B)",
    "request_ring_stream_order": "allow stream-ordered request rings (CUDA): a ring attached with ready_events "
                                 "makes each request's device work wait for the caller's CUDA event instead of the "
                                 "caller's host, and is answered once the work is queued. The caller is trusted with "
                                 "the server's device timeline: an event that never fires blocks every request behind "
                                 "it (docs/TRANSPORT.md)",
    "request_ring_stream_order_timeout_s": "a stream-ordered ring whose oldest request has not finished on the device "
                                           "within this many seconds, when the engine thread must wait for it, is "
                                           "detached (FAILED_PRECONDITION)",
    "otlp_endpoint": "send OpenTelemetry traces (a span per RPC, PrefillContext's stages under it) to this OTLP/gRPC "
                     "collector, e.g. http://otel-collector:4317 (https:// for TLS); off by default. The standard "
                     "OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ... are read too "
                     "(docs/DEPLOY.md, Tracing)",
}

#: --shared-memory value -> the region kinds it enables (``all``: cuda only on a CUDA device)
SHARED_MEMORY_MODES = {"off": (), "system": ("system",), "cuda": ("cuda",), "all": ("system", "cuda")}


#: flags whose value is one of a fixed set (argparse ``choices``; an environment value is held to them too)
_CHOICES: dict[str, tuple[str, ...]] = {
    "cache_dtype": CACHE_DTYPES, "prefill_dtype": PREFILL_DTYPES, "kv_b_proj_dtype": KV_B_PROJ_DTYPES,
    "shared_memory": tuple(SHARED_MEMORY_MODES), "kv_b_proj_gemm": GEMMS,
}
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


# Variables become flag defaults here, not through ConfigArgParse: its errors name the flag, not
# CTXPREFILL_<NAME>, and it maps variables onto subcommands' flags poorly (bw2/ConfigArgParse#275).
class _EnvValue(str):
    """A flag's default taken from ``CTXPREFILL_<NAME>``: argparse runs a string default
    through the flag's ``type=`` when the flag is not given, and the converter names the variable."""

    env: str

    def __new__(cls, env: str, value: str) -> _EnvValue:
        self = super().__new__(cls, value)
        self.env = env
        return self


def _strict_bool(value: str) -> bool:
    try:
        return _BOOLS[value.strip().lower()]
    except KeyError:
        raise ValueError(value) from None


def _converter(typ: Callable[[str], Any], choices: tuple[str, ...] | None) -> Callable[[str], Any]:
    """``typ`` for argparse; a value from the environment that it or ``choices`` refuses is
    reported as ``CTXPREFILL_<NAME>=...`` (argparse then exits with status 2)."""
    what = {int: "an integer", float: "a number", _strict_bool: "a boolean (1/0, true/false, yes/no, on/off)"}

    def convert(value: str) -> Any:
        try:
            out = typ(value)
        except ValueError:
            if isinstance(value, _EnvValue):
                raise argparse.ArgumentTypeError(f"{value.env}={str(value)!r} is not {what.get(typ, typ)}") from None
            raise
        if choices is not None and isinstance(value, _EnvValue) and out not in choices:
            raise argparse.ArgumentTypeError(f"{value.env}={str(value)!r} must be one of {', '.join(choices)}")
        return out

    convert.__name__ = getattr(typ, "__name__", "value")  # argparse's "invalid int value: 'x'" for a flag
    return convert


class _BoolFlag(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag``; ``type`` converts only a default from the environment
    (the flag itself takes no value)."""

    def __init__(self, *args: Any, env_type: Callable[[str], Any], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.type = env_type


def add_arguments(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServeSettings):
        flag = "--" + f.name.replace("_", "-")
        env = "CTXPREFILL_" + f.name.upper()
        default: Any = _EnvValue(env, os.environ[env]) if env in os.environ else f.default
        if f.type == "bool":
            p.add_argument(flag, action=_BoolFlag, env_type=_converter(_strict_bool, None), default=default,
                           help=f"{_HELP[f.name]} [{env}]")
            continue
        typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        choices = _CHOICES.get(f.name)
        shown = "%(default)s"
        if f.name in MODEL_FIELDS and env not in os.environ:  # unset: --model's config.json decides
            default = None
            shown = f"{f.default}" + ("" if f.name == "first_layer" else "; with --model, config.json's")
        p.add_argument(flag, type=_converter(typ, choices), choices=choices, default=default,
                       help=f"{_HELP[f.name]} (default: {shown}) [{env}]")


def from_args(ns: argparse.Namespace) -> ServeSettings:
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServeSettings) if hasattr(ns, f.name)}
    explicit = {k for k in MODEL_FIELDS if kw.get(k) is not None}  # given as a flag or in the environment
    kw = {k: v for k, v in kw.items() if not (k in MODEL_FIELDS and v is None)}
    return resolve_model(ServeSettings(**kw), explicit)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA device is available")
    return dev


def shared_memory_kinds(s: ServeSettings) -> tuple[str, ...]:
    """The shared-memory region kinds ``--shared-memory`` enables on this server's device,
    its limits and ``--request-ring`` (which needs system regions) checked (ConfigError
    naming the flag). ``cuda`` needs a CUDA device; ``all``
    enables cuda only on one."""
    mode = s.shared_memory
    if mode not in SHARED_MEMORY_MODES:
        raise ConfigError(f"--shared-memory must be one of {', '.join(SHARED_MEMORY_MODES)}, got {mode!r}")
    if not isinstance(s.shared_memory_max_regions, int) or s.shared_memory_max_regions < 1:
        raise ConfigError(f"--shared-memory-max-regions must be an integer >= 1, got {s.shared_memory_max_regions!r}")
    if not isinstance(s.shared_memory_max_bytes, int) or s.shared_memory_max_bytes < 1:
        raise ConfigError(f"--shared-memory-max-bytes must be an integer >= 1, got {s.shared_memory_max_bytes!r}")
    kinds = SHARED_MEMORY_MODES[mode]
    if "cuda" in kinds and resolve_device(s.device).type != "cuda":
        if mode == "cuda":
            raise ConfigError(f"--shared-memory cuda needs a CUDA device (--device {s.device} is not one)")
        kinds = tuple(k for k in kinds if k != "cuda")
    check_request_ring(s, kinds)
    return kinds


def ineffective_settings(s: ServeSettings) -> list[str]:
    """The settings changed from their defaults that tune a feature this configuration has
    off, each as ``"--flag (needs ...)"``: they do nothing. Logged as a warning, not refused,
    so that one set of flags (a values file, an environment) serves deployments with the
    feature on and off."""
    defaults = ServeSettings()
    random_weights = not s.weights and not s.model
    paged_on = s.kv_b_proj_gemm == "paged" and s.device != "cpu"  # (on the CPU the rule above names it)
    worker_heads = s.heads // max(1, s.num_shards)
    rules = (  # (settings, whether what they tune is on, what it needs)
        (("shared_memory_max_regions", "shared_memory_max_bytes", "shared_memory_pin"), s.shared_memory != "off",
         "--shared-memory"),
        (("request_ring_max", "request_ring_spin_us", "request_ring_poll_us", "request_ring_overlap",
          "request_ring_stream_order"), s.request_ring, "--request-ring"),
        (("request_ring_stream_order_timeout_s",), s.request_ring and s.request_ring_stream_order,
         "--request-ring-stream-order"),
        (("weights_prefix",), bool(s.weights), "--weights"),
        (("seed", "kv_b_proj_dtype"), random_weights, "random weights: no --weights or --model"),
        (("k_scale",), s.cache_dtype == "fp8", "--cache-dtype fp8: fp8_ds_mla keeps a scale per tile"),
        (("kv_b_proj_gemm",), s.device != "cpu", "a Hopper GPU: on the CPU torch multiplies"),
        (("kv_b_proj_gemm",), not paged_on or s.cache_dtype == "auto",
         "--cache-dtype auto to read the cache: other caches are gathered and go through cuBLAS"),
        (("kv_b_proj_gemm",), not paged_on or bool(s.model) or worker_heads < _PAGED_MAX_HEADS,
         f"fewer than {_PAGED_MAX_HEADS} heads a worker to read the cache: wider weights go through cuBLAS"),
    )

    def flag(name: str) -> str:  # as given: a switch turned off is its --no- form
        dashed = name.replace("_", "-")
        return f"--no-{dashed}" if getattr(s, name) is False and getattr(defaults, name) is True else f"--{dashed}"

    return [f"{flag(name)} (needs {needs})" for names, on, needs in rules if not on
            for name in names if getattr(s, name) != getattr(defaults, name)]


def check_request_ring(s: ServeSettings, kinds: tuple[str, ...]) -> None:
    """``--request-ring`` and its limits (ConfigError naming the flag)."""
    if not s.request_ring:
        return
    if "system" not in kinds:
        raise ConfigError("--request-ring needs --shared-memory system or all (a ring lives in a registered system "
                          "shared-memory region)")
    for name, lo, hi in (("request_ring_max", 1, 1024), ("request_ring_spin_us", 0, 10_000_000),
                         ("request_ring_poll_us", 1, 1_000_000)):
        v = getattr(s, name)
        if not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer in [{lo}, {hi}], got {v!r}")
    if s.request_ring_stream_order:
        if "cuda" not in kinds:
            raise ConfigError("--request-ring-stream-order needs CUDA regions (--shared-memory all on a CUDA device): "
                              "a stream-ordered request's tensors lie in them")
        t = s.request_ring_stream_order_timeout_s
        if not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ConfigError(f"--request-ring-stream-order-timeout-s must be in (0, 3600], got {t!r}")


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Which heads of the model a worker serves: ``[head_start, head_end)`` of ``total_heads``."""

    shard_index: int = 0
    num_shards: int = 1
    total_heads: int = 16

    @property
    def heads(self) -> int:
        return self.total_heads // self.num_shards

    @property
    def head_start(self) -> int:
        return self.shard_index * self.heads

    @property
    def head_end(self) -> int:
        return self.head_start + self.heads


def shard_spec(s: ServeSettings) -> ShardSpec:
    """The validated shard of ``--shard-index`` / ``--num-shards`` (ConfigError naming the flag)."""
    n, i, h = s.num_shards, s.shard_index, s.heads
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"--num-shards must be an integer >= 1, got {n!r}")
    if not isinstance(i, int) or not 0 <= i < n:
        raise ConfigError(f"--shard-index must be in [0, {n}) for --num-shards {n}, got {i!r}")
    if not isinstance(h, int) or h < 1:
        raise ConfigError(f"--heads must be an integer >= 1, got {h!r}")
    if h % n:
        raise ConfigError(f"--heads {h} (the model's total heads when sharded) is not divisible by --num-shards {n}")
    return ShardSpec(i, n, h)


def check_serve_settings(s: ServeSettings) -> None:
    """The server's own limits and ports."""
    if not (s.grace_seconds >= 0):
        raise ConfigError(f"--grace-seconds must be >= 0, got {s.grace_seconds}")
    if not (4 << 20 <= s.max_message_bytes <= 2**31 - 1):
        raise ConfigError(f"--max-message-bytes must be in [{4 << 20}, {2**31 - 1}], got {s.max_message_bytes}")
    if s.queue_size < 1:
        raise ConfigError(f"--queue-size must be >= 1, got {s.queue_size}")
    if not s.max_message_bytes <= s.max_inflight_bytes <= 2**50:
        raise ConfigError(f"--max-inflight-bytes must be in [--max-message-bytes ({s.max_message_bytes}), {2**50}] "
                          f"(one message must fit), got {s.max_inflight_bytes}")
    if s.max_answer_bytes < 1:
        raise ConfigError(f"--max-answer-bytes must be >= 1, got {s.max_answer_bytes}")
    if not 0 < s.receive_timeout_s <= 86400:
        raise ConfigError(f"--receive-timeout-s must be in (0, 86400] seconds, got {s.receive_timeout_s}")
    if not 0 < s.send_timeout_s <= 86400:
        raise ConfigError(f"--send-timeout-s must be in (0, 86400] seconds, got {s.send_timeout_s}")
    if not 0.1 <= s.keepalive_time_s <= 86400:
        raise ConfigError(f"--keepalive-time-s must be in [0.1, 86400] seconds, got {s.keepalive_time_s}")
    if not 0.1 <= s.keepalive_timeout_s <= 3600:
        raise ConfigError(f"--keepalive-timeout-s must be in [0.1, 3600] seconds, got {s.keepalive_timeout_s}")
    for name in ("port", "metrics_port"):
        v = getattr(s, name)
        if not 0 <= v <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {v}")


def check_engine_settings(s: ServeSettings) -> None:
    """The engine's cheap configuration checks, before any port is bound (the full build,
    weights included, runs after binding so that liveness answers while it loads)."""
    shape = ModelShape(heads=s.heads, softmax_scale=s.softmax_scale)
    cache = CacheConfig(s.cache_dtype, s.block_size, s.num_blocks, s.k_scale)
    config = EngineConfig(shape=shape, cache=cache, kv_b_proj_dtype="bf16" if s.weights else s.kv_b_proj_dtype,
                          prefill_dtype=s.prefill_dtype, workspace_tokens=s.workspace_tokens, fused=not s.generic,
                          backend=s.backend, max_context_token_heads=s.max_context_token_heads)
    device = resolve_device(s.device)
    if s.backend != "auto":  # a named backend this device cannot run (auto picks among those that can)
        try:
            registry.requested(s.backend, device, q_dtype(config))
        except (ValueError, ImportError) as e:
            raise ConfigError(f"--backend {s.backend}: {e}") from None
    shard_spec(s)  # --shard-index / --num-shards against --heads
    if s.weights and not os.path.isfile(s.weights):
        raise ConfigError(f"--weights: no such file {s.weights!r}")


def layer_prefix(prefix: str, layer: int, num_layers: int) -> str:
    """The weights-file key prefix of model layer ``layer`` (``--weights-prefix``): ``{layer}``
    in ``prefix`` replaced by its index; without one, the prefix as it is, for one layer only."""
    if "{layer}" in prefix:
        return prefix.replace("{layer}", str(layer))
    if num_layers > 1:
        raise ConfigError(f"--weights-prefix {prefix!r} has no {{layer}}: with --layers {num_layers} each layer needs "
                          f"its own kv_b_proj, e.g. --weights-prefix 'model.layers.{{layer}}.self_attn.'")
    return prefix
