"""A Hugging Face checkpoint directory of a DeepSeek-V2/V3-architecture model (``--model DIR``).

What a server takes from it (CONTRACT §1, §8):
- ``config.json``: the head count, the layer count, the MLA dims (refused unless the
  kernels serve them) and the softmax scale, computed as transformers' DeepSeek-V2/V3
  attention does (``softmax_scale``); ``quantization_config`` (fp8, 128×128 blocks);
- each served layer's ``model.layers.{i}.self_attn.kv_b_proj.weight`` [H*(P+V), L] (with its
  ``weight_scale_inv`` when fp8), found through ``model.safetensors.index.json``'s weight map
  (or in a single ``model.safetensors``). Only the shards holding those tensors are opened,
  memory-mapped, and only those tensors are read: of a head shard, only its heads' rows —
  but for an fp8 weight whose rows there are exact in bf16, the whole weight, read to decide
  the compute dtype as an unsharded server does (``_whole_exact``).
Every problem is a ConfigError naming the file, the field or the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Collection, Sequence
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from .config import MAX_LAYERS
from .errors import ConfigError
from .weights import BLOCK, KvBProjWeights, check_finite, dequantize, exact_in_bf16, prepare

#: the loader's lines: per-shard and per-layer lines at DEBUG; progress of a long load and
#: the summary at INFO (shown by default once the server has set up logging: a child of the
#: lifecycle logger)
log = logging.getLogger("ctxprefill.lifecycle.model")
#: a load still going logs a progress line this often (seconds): a short one logs none
PROGRESS_EVERY_S = 5.0


class _Progress:
    """``loading model`` INFO lines while a step (reading the shard files, preparing the
    layers) goes on: one every :data:`PROGRESS_EVERY_S` seconds, with how far it is."""

    def __init__(self, step: str, total: int, t0: float):
        self.step, self.total, self.t0 = step, total, t0
        self.last = time.perf_counter()

    def done(self, n: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("loading model", extra={"step": self.step, "done": n, "of": self.total,
                                             "percent": round(100 * n / max(1, self.total)),
                                             "seconds": round(now - self.t0, 1)})

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: the MLA dims the kernels serve (config.json field -> value)
SERVED_DIMS = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
QUANT_METHODS = ("fp8",)
#: safetensors dtype names of a kv_b_proj weight, and of its block scale
WEIGHT_DTYPES = {"BF16": "bf16", "F8_E4M3": "fp8"}
SCALE_DTYPES = ("F32", "BF16", "F16")


def weight_key(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight"


def scale_key(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.kv_b_proj.weight_scale_inv"


# ----------------------------------------------------------------------------- config.json


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What config.json says about the attention a server computes."""

    path: str  # the checkpoint directory, absolute
    model_type: str
    num_heads: int  # num_attention_heads
    num_layers: int  # num_hidden_layers
    mtp_layers: int  # num_nextn_predict_layers: stored after the others (model.layers.{num_layers}...)
    softmax_scale: float
    scale_rule: str  # how softmax_scale was computed, for the log
    quant_method: str | None  # "fp8" or None (bf16 weights)
    name: str  # _name_or_path when set, else the directory's name

    @property
    def max_layers(self) -> int:
        """Layers whose attention the checkpoint stores (the MTP ones included)."""
        return self.num_layers + self.mtp_layers


def _int_field(cfg: dict[str, Any], name: str, lo: int = 1) -> int:
    v = cfg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"config.json's {name} must be an integer >= {lo}, got {v!r}")
    return v


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` (or ``rope_parameters``, transformers >= 5; rope_scaling wins as there)
    with ``rope_type`` defaulted from the older ``type``, as transformers standardizes them."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json's rope_scaling must be an object or null, got {params!r}")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """transformers' DeepSeek-V2/V3 ``yarn_get_mscale``."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: dict[str, Any]) -> tuple[float, str]:
    """(scale, how) as transformers' DeepseekV3Attention / DeepseekV2Attention set ``scaling``:
    ``qk_head_dim ** -0.5``, times ``mscale**2`` with ``mscale = yarn_get_mscale(factor,
    mscale_all_dim)`` when the rope type is not "default" and ``mscale_all_dim`` is set."""
    qk_head_dim = _int_field(cfg, "qk_nope_head_dim") + _int_field(cfg, "qk_rope_head_dim")
    scale = qk_head_dim**-0.5
    how = f"qk_head_dim {qk_head_dim} ** -0.5"
    params = rope_parameters(cfg)
    if params["rope_type"] != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if "factor" not in params:
            raise ConfigError(f"config.json's rope_scaling of type {params['rope_type']!r} has no factor")
        factor = params["factor"]
        for name, v in (("factor", factor), ("mscale_all_dim", mscale_all_dim)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"config.json's rope_scaling.{name} must be a finite number, got {v!r}")
        if mscale_all_dim:
            mscale = yarn_get_mscale(factor, mscale_all_dim)
            scale = scale * mscale * mscale
            how += (f" x mscale**2, mscale = 0.1 * mscale_all_dim {mscale_all_dim} * ln(factor {factor}) + 1"
                    if factor > 1 else " (rope factor <= 1: mscale 1)")
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"config.json gives a softmax scale of {scale!r} ({how}); it must be finite and > 0")
    return scale, how


def _quant_method(cfg: dict[str, Any]) -> str | None:
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"config.json's quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(f"config.json's quantization_config.quant_method {method!r} is not supported: only "
                          f"\"fp8\" (e4m3 weights with 128x128 weight_scale_inv blocks) is")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json's quantization_config.fmt {q.get('fmt')!r} is not supported: only \"e4m3\" is")
    block = q.get("weight_block_size")
    if list(block or ()) != [BLOCK, BLOCK]:
        raise ConfigError(f"config.json's quantization_config.weight_block_size is {block!r}: only "
                          f"[{BLOCK}, {BLOCK}] is supported")
    return "fp8"


def read_model_config(path: str) -> ModelConfig:
    """``path``/config.json, checked (ConfigError naming the file or the field)."""
    if not os.path.isdir(path):
        raise ConfigError(f"--model {path!r}: no such directory (a Hugging Face checkpoint directory is expected)")
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise ConfigError(f"--model {path!r}: no {CONFIG} in it (a Hugging Face checkpoint directory holds "
                          f"{CONFIG} and its safetensors shards)")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model: {file} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model: {file} must hold a JSON object")
    model_type = str(cfg.get("model_type", ""))
    missing = [k for k in SERVED_DIMS if k not in cfg]
    if missing:
        raise ConfigError(f"config.json has no {', '.join(missing)}: model_type {model_type!r} is not a "
                          f"DeepSeek-V2/V3-architecture (MLA) model")
    for k, want in SERVED_DIMS.items():
        got = cfg[k]
        if got != want:
            raise ConfigError(f"config.json's {k} is {got!r}; the kernels serve {k} {want} only "
                              f"(L=512, P=128, R=64, V=128: DeepSeek-V2/V3, Kimi K2)")
    heads = _int_field(cfg, "num_attention_heads")
    layers = _int_field(cfg, "num_hidden_layers")
    mtp = cfg.get("num_nextn_predict_layers", 0) or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise ConfigError(f"config.json's num_nextn_predict_layers must be an integer >= 0, got {mtp!r}")
    scale, how = softmax_scale(cfg)
    absolute = os.path.abspath(path)
    name = cfg.get("_name_or_path") or os.path.basename(absolute.rstrip(os.sep))
    return ModelConfig(absolute, model_type, heads, layers, mtp, scale, how, _quant_method(cfg), str(name))


# ----------------------------------------------------------------------------- what is served


@dataclasses.dataclass(frozen=True)
class Selection:
    """What a server serves of a model: the model's heads (all shards together), its layers
    [first_layer, first_layer + num_layers), the softmax scale."""

    heads: int
    first_layer: int
    num_layers: int
    softmax_scale: float


def select(model: ModelConfig, heads: int | None = None, first_layer: int | None = None,
           num_layers: int | None = None, softmax_scale: float | None = None) -> Selection:
    """config.json's values, each replaced by its flag when given (None: not given); every
    replacement logged. Layers: all of them by default, [F, num_hidden_layers) with
    ``--first-layer F`` alone; an explicit range may reach the MTP layers stored after them."""
    def overrides(flag: str, value: object, field: str, theirs: object, warn: bool = True) -> None:
        """A flag that contradicts the model's own config.json is a warning; a layer range is not."""
        level = logging.WARNING if warn and value != theirs else logging.INFO
        log.log(level, f"flag {flag} {value} overrides config.json's {field} ({theirs})",
                extra={"model": model.path, "flag": flag, "value": value, "config_field": field, "config": theirs})

    first = 0 if first_layer is None else first_layer
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ConfigError(f"--first-layer must be an integer >= 0, got {first!r}")
    if num_layers is None:
        if first >= model.num_layers:
            raise ConfigError(f"--first-layer {first}: config.json's num_hidden_layers is {model.num_layers}, the "
                              f"model's layers are [0, {model.num_layers})")
        n = model.num_layers - first
    else:
        n = num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"--layers must be an integer >= 1, got {n!r}")
        if first + n > model.max_layers:
            mtp = f" and {model.mtp_layers} MTP layer(s) after them" if model.mtp_layers else ""
            raise ConfigError(f"--first-layer {first} --layers {n} asks for layers [{first}, {first + n}); "
                              f"config.json's num_hidden_layers is {model.num_layers}{mtp}: the model has layers "
                              f"[0, {model.max_layers})")
        overrides("--layers", n, "num_hidden_layers", model.num_layers, warn=False)
    if n > MAX_LAYERS:
        raise ConfigError(f"the model has {n} layers from --first-layer {first}; a server holds at most {MAX_LAYERS}: "
                          f"select fewer with --layers")
    if heads is not None:
        overrides("--heads", heads, "num_attention_heads", model.num_heads)
    if softmax_scale is not None:
        overrides("--softmax-scale", softmax_scale, "softmax scale", model.softmax_scale)
    return Selection(model.num_heads if heads is None else heads, first, n,
                     model.softmax_scale if softmax_scale is None else softmax_scale)


#: the settings fields ``--model`` decides unless they are given explicitly
MODEL_FIELDS = ("heads", "layers", "first_layer", "softmax_scale")

S = TypeVar("S")


def resolve_model(settings: S, explicit: Collection[str] = ()) -> S:
    """``settings`` (a ServeSettings) with heads, layers, first_layer and softmax_scale taken from
    ``--model``'s config.json, except those named in ``explicit`` (flags the user gave), which
    override it. Without ``--model``, ``settings`` as it is. Checks the directory up front:
    config.json, the weight files and that every served tensor is in them."""
    path = getattr(settings, "model", None)
    if not path:
        return settings
    if getattr(settings, "weights", None):
        raise ConfigError("--model and --weights are exclusive: --model reads each layer's kv_b_proj from the "
                          "checkpoint directory")
    model = read_model_config(path)
    given = {k: getattr(settings, k) if k in explicit else None for k in MODEL_FIELDS}
    sel = select(model, heads=given["heads"], first_layer=given["first_layer"], num_layers=given["layers"],
                 softmax_scale=given["softmax_scale"])
    weight_files(model, range(sel.first_layer, sel.first_layer + sel.num_layers))  # every tensor is somewhere
    return dataclasses.replace(settings, model=model.path, heads=sel.heads,  # type: ignore[type-var]
                               first_layer=sel.first_layer, layers=sel.num_layers, softmax_scale=sel.softmax_scale)


# ----------------------------------------------------------------------------- the weight files


def weight_map(path: str) -> dict[str, str]:
    """Tensor name -> the file (absolute) holding it: ``model.safetensors.index.json``'s
    weight map, or the names in a single ``model.safetensors``."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"--model: {index} is not a readable JSON object ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ConfigError(f"--model: {index} has no weight_map object of tensor name -> file")
        return {k: os.path.join(path, v) for k, v in wm.items()}
    single = os.path.join(path, SINGLE)
    if not os.path.isfile(single):
        raise ConfigError(f"--model {path!r}: neither {INDEX} nor {SINGLE} is in it")
    try:
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    except SafetensorError as e:
        raise ConfigError(f"--model: {single} is not a readable safetensors file ({e})") from None


def weight_files(model: ModelConfig, layers: Sequence[int]) -> dict[str, list[str]]:
    """File -> the tensors to read from it (each layer's kv_b_proj weight, and its
    weight_scale_inv when the checkpoint has one), in layer order; ConfigError naming a
    tensor that no file holds or a file that is missing."""
    wm = weight_map(model.path)
    files: dict[str, list[str]] = {}
    for layer in layers:
        if weight_key(layer) not in wm:
            raise ConfigError(f"--model {model.path}: no tensor {weight_key(layer)!r} (layer {layer}) in its "
                              f"{INDEX if os.path.isfile(os.path.join(model.path, INDEX)) else SINGLE}")
        if model.quant_method == "fp8" and scale_key(layer) not in wm:
            raise ConfigError(f"--model {model.path}: no tensor {scale_key(layer)!r} (layer {layer}): config.json's "
                              f"quantization_config says fp8 with block scales")
        for key in (weight_key(layer), scale_key(layer)):
            if key in wm:
                files.setdefault(wm[key], []).append(key)
    for file in files:
        if not os.path.isfile(file):
            raise ConfigError(f"--model: {file} (named by {INDEX}) does not exist")
    return files


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class _Read:
    """What was read of one tensor: its full shape and dtype, and the rows taken."""

    shape: list[int]
    dtype: str
    rows: tuple[int, int]
    tensor: torch.Tensor


def _read_rows(f: Any, key: str, rows: tuple[int, int] | None) -> _Read:
    """Rows [r0, r1) of tensor ``key`` (all rows when None), read through a memory-mapped slice."""
    sl = f.get_slice(key)
    shape, dtype = list(sl.get_shape()), sl.get_dtype()
    if len(shape) != 2:
        raise ConfigError(f"--model: {key} has shape {shape}; a 2-D [out, in] weight is expected")
    r0, r1 = rows if rows is not None else (0, shape[0])
    r1 = min(r1, shape[0])
    return _Read(shape, dtype, (r0, r1), sl[r0:r1])


def load_model_kv_b_proj(path: str, first_layer: int, num_layers: int, heads: int, shard_index: int = 0,
                         num_shards: int = 1) -> list[KvBProjWeights]:
    """Layers [first_layer, first_layer + num_layers) of the checkpoint's kv_b_proj, of the heads
    [shard_index * heads / num_shards, (shard_index + 1) * heads / num_shards) of its ``heads``
    (the model's): each as ``shard_kv_b_proj`` would slice the full prepared weight. Logs a line
    per shard file and per layer (DEBUG) and the total (INFO)."""
    t0 = time.perf_counter()
    model = read_model_config(path)
    layers = range(first_layer, first_layer + num_layers)
    files = weight_files(model, layers)
    P, V = SERVED_DIMS["qk_nope_head_dim"], SERVED_DIMS["v_head_dim"]
    if heads % num_shards:
        raise ConfigError(f"--heads {heads} is not divisible by --num-shards {num_shards}")
    per = heads // num_shards
    rows = (shard_index * per * (P + V), (shard_index + 1) * per * (P + V))
    scale_rows = (rows[0] // BLOCK, math.ceil(rows[1] / BLOCK))
    if num_shards > 1 and (rows[0] % BLOCK or rows[1] % BLOCK):  # unreachable at P+V = 256
        raise ConfigError(f"kv_b_proj shard rows [{rows[0]}, {rows[1]}) do not align with the {BLOCK}-row scale blocks")
    read: dict[str, _Read] = {}
    total_bytes = 0
    progress = _Progress("reading shard files", len(files), t0)
    for n_read, (file, keys) in enumerate(files.items(), 1):
        t = time.perf_counter()
        nbytes = 0
        try:
            with safe_open(file, framework="pt") as f:
                for key in keys:
                    r = _read_rows(f, key, scale_rows if key.endswith("_scale_inv") else rows)
                    read[key] = r
                    nbytes += r.tensor.numel() * r.tensor.element_size()
        except SafetensorError as e:
            raise ConfigError(f"--model: {file} is not a readable safetensors file ({e})") from None
        total_bytes += nbytes
        log.debug("read shard", extra={"file": os.path.basename(file), "tensors": len(keys), "bytes": nbytes,
                                       "seconds": round(time.perf_counter() - t, 3)})
        progress.done(n_read)
    out = []
    progress = _Progress("preparing layers", len(layers), t0)
    for layer in layers:
        w = _layer(model, layer, read, heads, rows, num_shards, files)
        out.append(w)
        log.debug("layer loaded", extra={"layer": layer, "dtype": w.dtype, "rows": f"[{rows[0]}, {rows[1]})",
                                         "compute_dtype": str(w.compute.dtype).removeprefix("torch.")})
        progress.done(len(out))
    dtypes = sorted({w.dtype for w in out})
    if len(dtypes) > 1:
        raise ConfigError(f"--model {model.path}: the layers' kv_b_proj weights differ in dtype ({', '.join(dtypes)})")
    log.info("model loaded", extra={
        "model": model.path, "model_name": model.name, "model_type": model.model_type,
        "layers": f"[{first_layer}, {first_layer + num_layers}) of {model.num_layers}", "heads": heads,
        "shard": f"{shard_index} of {num_shards}", "kv_b_proj_dtype": dtypes[0], "files_opened": len(files),
        "bytes_read": total_bytes, "seconds": round(time.perf_counter() - t0, 3)})
    return out


def _layer(model: ModelConfig, layer: int, read: dict[str, _Read], heads: int, rows: tuple[int, int],
           num_shards: int, files: dict[str, list[str]]) -> KvBProjWeights:
    """One layer's prepared (and checked) weights from the tensors read."""
    P, V, L = SERVED_DIMS["qk_nope_head_dim"], SERVED_DIMS["v_head_dim"], SERVED_DIMS["kv_lora_rank"]
    key = weight_key(layer)
    w = read[key]
    want = [heads * (P + V), L]
    if w.shape != want:
        raise ConfigError(
            f"--model: {key} has shape {w.shape}; config.json (num_attention_heads {model.num_heads}, "
            f"qk_nope_head_dim {P}, v_head_dim {V}, kv_lora_rank {L}) and --heads {heads} give {want}")
    dtype = WEIGHT_DTYPES.get(w.dtype)
    if dtype is None:
        raise ConfigError(f"--model: {key} has dtype {w.dtype}; BF16 or F8_E4M3 expected")
    what = f"--model: layer {layer}'s {key}"
    if dtype == "bf16":
        weights = prepare("bf16", w.tensor, None)
        check_finite(weights, what)
        return weights
    if model.quant_method != "fp8":
        raise ConfigError(f"--model: {key} is F8_E4M3 but config.json has no quantization_config (fp8) saying so")
    s = read.get(scale_key(layer))
    if s is None:
        raise ConfigError(f"--model: {key} is F8_E4M3 but the checkpoint has no {scale_key(layer)}")
    want_s = [math.ceil(want[0] / BLOCK), math.ceil(want[1] / BLOCK)]
    if s.shape != want_s:
        raise ConfigError(f"--model: {scale_key(layer)} has shape {s.shape}, expected {want_s} "
                          f"([ceil(N/{BLOCK}), ceil(L/{BLOCK})] for {key} {want})")
    if s.dtype not in SCALE_DTYPES:
        raise ConfigError(f"--model: {scale_key(layer)} has dtype {s.dtype}; {', '.join(SCALE_DTYPES)} expected")
    scale = s.tensor.float()
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ConfigError(f"--model: layer {layer}'s {scale_key(layer)} holds scales that are not finite and "
                          f"positive: refusing to serve it")
    weights = prepare("fp8", w.tensor, scale)
    if num_shards > 1 and weights.compute.dtype == torch.bfloat16 \
            and not _whole_exact(files, key, scale_key(layer)):
        # exact in bf16 on this shard's rows: the whole weight decides (as shard_kv_b_proj does), so
        # the rest of it is read; where it is not exact, neither is any shard: W_deq in float32
        # (these rows' bf16 values, widened exactly)
        weights = dataclasses.replace(weights, compute=weights.compute.float())
    check_finite(weights, what)
    return weights


def _whole_exact(files: dict[str, list[str]], key: str, skey: str) -> bool:
    """Whether the whole of ``key``, dequantized with ``skey``, is exact in bf16."""
    full: dict[str, torch.Tensor] = {}
    for file, keys in files.items():
        wanted = [k for k in (key, skey) if k in keys]
        if wanted:
            with safe_open(file, framework="pt") as f:
                for k in wanted:
                    full[k] = f.get_tensor(k)
    return exact_in_bf16(dequantize(full[key], full[skey].float()))
