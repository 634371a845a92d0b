"""A Hugging Face checkpoint directory as the model (``serve --model DIR``, ``make-model``):
config.json's heads, layers, dims and softmax scale (transformers' DeepSeek-V3 formula),
only the shards and tensors of the served layers read, fp8 block scales, head shards, flag
overrides, and each bad directory refused with one line naming the problem."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ctxprefill.checkpoint as ckpt
from ctxprefill.app import build_engine
from ctxprefill.checkpoint import load_model_kv_b_proj, read_model_config, resolve_model, scale_key, select, weight_key
from ctxprefill.checkpoint_writer import TinyModel, write_model
from ctxprefill.cli import main
from ctxprefill.config import ModelShape
from ctxprefill.errors import ConfigError
from ctxprefill.ops.fp8 import FP8
from ctxprefill.settings import ServeSettings, add_arguments, from_args
from ctxprefill.weights import BLOCK, dequantize, load_kv_b_proj, prepare, random_kv_b_proj, shard_kv_b_proj
from ctxprefill_api import pb
from service_process import ROOT, env_with_sources

P, R, V, L = 128, 64, 128, 512


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def same(a, b) -> bool:
    """Two prepared weights hold the same bits (weight, scale, compute) and dtypes."""
    return (a.dtype == b.dtype and a.compute.dtype == b.compute.dtype and torch.equal(bits(a.weight), bits(b.weight))
            and torch.equal(bits(a.compute), bits(b.compute))
            and (a.scale is None) == (b.scale is None) and (a.scale is None or torch.equal(a.scale, b.scale)))


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "fp8")
    write_model(path, TinyModel(layers=6, heads=4, dtype="fp8", shards=6, seed=11, yarn=True))
    return path


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "bf16")
    write_model(path, TinyModel(layers=3, heads=4, dtype="bf16", shards=2, seed=5))
    return path


def copy_of(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del cfg[k]
    with open(file, "w") as f:
        json.dump(cfg, f)


def index_of(path: str) -> dict[str, str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"]


def edit_tensor(path: str, key: str, fn) -> None:
    """Rewrite the shard holding ``key`` with ``fn(tensor)`` in its place."""
    file = os.path.join(path, index_of(path)[key])
    tensors = load_file(file)
    tensors[key] = fn(tensors[key])
    save_file(tensors, file, metadata={"format": "pt"})


# ------------------------------------------------------------------------- config.json


def scale_formula(qk_head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """DeepSeek-V3's YaRN attention scale, written out: s = (P+R)^-1/2 * (1 + 0.1 m ln f)^2 for f > 1."""
    m = 1.0 + 0.1 * mscale_all_dim * math.log(factor) if factor > 1 else 1.0
    return m * m / math.sqrt(qk_head_dim)


BASE_CFG = {"model_type": "deepseek_v3", "num_attention_heads": 128, "num_hidden_layers": 61,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


@pytest.mark.parametrize("rope,expected", [
    (None, 192**-0.5),
    ({"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0}, scale_formula(192, 40, 1.0)),  # V3
    ({"type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0}, scale_formula(192, 32, 1.0)),  # K2
    ({"type": "yarn", "factor": 40, "mscale_all_dim": 0.707}, scale_formula(192, 40, 0.707)),  # V2
    ({"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}, scale_formula(192, 40, 1.0)),
    ({"type": "yarn", "factor": 40, "mscale": 1.0}, 192**-0.5),  # no mscale_all_dim: no correction
    ({"type": "yarn", "factor": 0.5, "mscale_all_dim": 1.0}, 192**-0.5),  # factor <= 1: mscale 1
    ({"type": "default", "factor": 40, "mscale_all_dim": 1.0}, 192**-0.5),
    ({"type": "linear", "factor": 4, "mscale_all_dim": 1.0}, scale_formula(192, 4, 1.0)),  # any non-default type
])
def test_softmax_scale_is_transformers_deepseek_v3s(tmp_path, rope, expected):
    for field in ("rope_scaling", "rope_parameters"):  # rope_parameters: transformers >= 5
        d = tmp_path / field
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**BASE_CFG, field: rope}))
        m = read_model_config(str(d))
        assert m.softmax_scale == pytest.approx(expected, rel=1e-15)
    if rope and rope.get("type") == "yarn" and rope["factor"] == 40 and rope.get("mscale_all_dim") == 1.0:
        assert m.softmax_scale == pytest.approx(0.1352337788608801, rel=1e-12)  # DeepSeek-V3's


def test_rope_scaling_wins_over_rope_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        **BASE_CFG, "rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": 1.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000}}))
    assert read_model_config(str(tmp_path)).softmax_scale == pytest.approx(scale_formula(192, 40, 1.0))


def test_config_of_a_written_model(fp8_model, bf16_model):
    m = read_model_config(fp8_model)
    assert (m.model_type, m.num_heads, m.num_layers, m.quant_method) == ("deepseek_v3", 4, 6, "fp8")
    assert m.path == os.path.abspath(fp8_model) and m.name == "fp8"
    assert m.softmax_scale == pytest.approx(scale_formula(192, 40, 1.0))
    b = read_model_config(bf16_model)
    assert (b.num_heads, b.num_layers, b.quant_method, b.softmax_scale) == (4, 3, None, 192**-0.5)


def test_layer_range_selection(fp8_model):
    m = read_model_config(fp8_model)
    assert select(m) == ckpt.Selection(4, 0, 6, m.softmax_scale)  # all layers by default
    assert select(m, first_layer=2) == ckpt.Selection(4, 2, 4, m.softmax_scale)  # [2, num_hidden_layers)
    assert select(m, first_layer=1, num_layers=3) == ckpt.Selection(4, 1, 3, m.softmax_scale)
    with pytest.raises(ConfigError, match=r"--first-layer 4 --layers 3 .*num_hidden_layers is 6"):
        select(m, first_layer=4, num_layers=3)
    with pytest.raises(ConfigError, match=r"--first-layer 6: config.json's num_hidden_layers is 6"):
        select(m, first_layer=6)
    for bad, message in ((dict(first_layer=-1), r"--first-layer must be an integer >= 0, got -1"),
                         (dict(first_layer=True), r"--first-layer must be an integer >= 0, got True"),
                         (dict(num_layers=0), r"--layers must be an integer >= 1, got 0")):
        with pytest.raises(ConfigError, match=message):
            select(m, **bad)
    with pytest.raises(ConfigError, match=r"the model has 1025 layers from --first-layer 0; a server holds at most "
                                          r"1024: select fewer with --layers"):
        select(dataclasses.replace(m, num_layers=1025))
    mtp = dataclasses.replace(m, mtp_layers=1)  # DeepSeek-V3 stores its MTP layer as model.layers.61
    assert select(mtp) == ckpt.Selection(4, 0, 6, m.softmax_scale)
    assert select(mtp, first_layer=6, num_layers=1).first_layer == 6


# ------------------------------------------------------------------------- reading


class Spy:
    """Records the files safe_open opens and the tensors read from them (and how)."""

    def __init__(self, monkeypatch):
        self.files: list[str] = []
        self.reads: list[tuple[str, str, tuple[int, ...]]] = []  # (how, key, shape read)
        real = ckpt.safe_open
        spy = self

        class Handle:
            def __init__(self, f):
                self.f = f

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                t = self.f.get_tensor(key)
                spy.reads.append(("tensor", key, tuple(t.shape)))
                return t

            def get_slice(self, key):
                sl = self.f.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def get_dtype(self):
                        return sl.get_dtype()

                    def __getitem__(self, idx):
                        t = sl[idx]
                        spy.reads.append(("slice", key, tuple(t.shape)))
                        return t

                return Slice()

        @contextlib.contextmanager
        def spy_open(path, framework):
            assert framework == "pt"
            spy.files.append(os.path.basename(path))
            with real(path, framework=framework) as f:
                yield Handle(f)

        monkeypatch.setattr(ckpt, "safe_open", spy_open)


def test_only_the_served_layers_shards_and_tensors_are_read(fp8_model, monkeypatch):
    wm = index_of(fp8_model)
    assert len(set(wm.values())) == 6
    spy = Spy(monkeypatch)
    [w] = load_model_kv_b_proj(fp8_model, 3, 1, 4)
    assert sorted(set(spy.files)) == sorted({wm[weight_key(3)], wm[scale_key(3)]})
    assert len(spy.files) == len(set(spy.files)) < 6  # each once, and not all of them
    assert sorted(spy.reads) == sorted([("slice", weight_key(3), (4 * (P + V), L)),
                                        ("slice", scale_key(3), (8, 4))])
    assert w.weight.shape == (4 * (P + V), L) and w.dtype == "fp8"


def test_a_layer_split_across_two_shards_is_read_from_both(tmp_path, fp8_model, monkeypatch):
    path = copy_of(fp8_model, tmp_path / "m")
    wm = index_of(path)
    key, skey = weight_key(2), scale_key(2)
    src = os.path.join(path, wm[skey])
    tensors = load_file(src)
    scale = tensors.pop(skey)
    save_file(tensors, src, metadata={"format": "pt"})
    save_file({skey: scale}, os.path.join(path, "extra.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {**wm, skey: "extra.safetensors"}}, f)
    spy = Spy(monkeypatch)
    [w] = load_model_kv_b_proj(path, 2, 1, 4)
    assert sorted(spy.files) == sorted([wm[key], "extra.safetensors"])
    assert torch.equal(w.scale, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_block_scales_load_as_their_float32_values(fp8_model, tmp_path, dtype):
    """Scales stored in BF16 or F16 (SCALE_DTYPES) dequantize as the same values in F32 do."""
    path = copy_of(fp8_model, tmp_path / "m")
    edit_tensor(path, scale_key(0), lambda t: t.to(dtype))
    as_f32 = copy_of(path, tmp_path / "f32")
    edit_tensor(as_f32, scale_key(0), lambda t: t.float())
    [w], [want] = load_model_kv_b_proj(path, 0, 1, 4), load_model_kv_b_proj(as_f32, 0, 1, 4)
    assert same(w, want) and torch.equal(w.compute, want.compute)


def test_fp8_block_scales_dequantize_as_weights_py_does(fp8_model, tmp_path):
    ws = load_model_kv_b_proj(fp8_model, 0, 6, 4)
    wm = index_of(fp8_model)
    for layer, w in enumerate(ws):
        key, skey = weight_key(layer), scale_key(layer)
        with safe_open(os.path.join(fp8_model, wm[key]), framework="pt") as f:
            raw = f.get_tensor(key)
        with safe_open(os.path.join(fp8_model, wm[skey]), framework="pt") as f:
            scale = f.get_tensor(skey)
        assert raw.dtype == FP8 and scale.shape == (8, 4) and scale.dtype == torch.float32
        assert same(w, prepare("fp8", raw, scale))
        assert torch.equal(w.compute, dequantize(raw, scale))  # arbitrary block scales: fp32 W_deq
        t = random_kv_b_proj(ModelShape(heads=4), "fp8", 11 + layer)  # make-model: seed + layer
        assert torch.equal(bits(w.weight), bits(t["kv_b_proj.weight"]))
        # the same tensors in a --weights file load to the same bits
        single = str(tmp_path / f"l{layer}.safetensors")
        save_file({f"model.layers.{layer}.self_attn.kv_b_proj.weight": raw,
                   f"model.layers.{layer}.self_attn.kv_b_proj.weight_scale_inv": scale}, single)
        assert same(w, load_kv_b_proj(single, ModelShape(heads=4), f"model.layers.{layer}.self_attn."))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("model", ["fp8_model", "bf16_model"])
def test_head_shards_are_the_rows_of_the_full_weight(request, model, n, monkeypatch):
    path = request.getfixturevalue(model)
    H = read_model_config(path).num_heads
    full = load_model_kv_b_proj(path, 0, 2, H)
    for i in range(n):
        spy = Spy(monkeypatch)
        part = load_model_kv_b_proj(path, 0, 2, H, i, n)
        for f, p in zip(full, part, strict=True):
            assert same(p, shard_kv_b_proj(f, H, i, n))
        rows = H // n * (P + V)
        assert all(shape[0] == (rows if how == "slice" and "scale" not in k else rows // BLOCK)
                   for how, k, shape in spy.reads)  # only this shard's rows were read
        assert {how for how, _, _ in spy.reads} == {"slice"}


def test_a_shard_takes_the_whole_weights_bf16_decision(tmp_path, fp8_model):
    """Power-of-two scales on shard 0's rows (exact in bf16 alone), arbitrary ones on shard 1's:
    shard 0 computes in fp32 like the whole weight, as shard_kv_b_proj decides."""
    path = copy_of(fp8_model, tmp_path / "m")
    edit_tensor(path, scale_key(0), lambda s: torch.cat([torch.full_like(s[:4], 2.0**-8), s[4:]]))
    [full] = load_model_kv_b_proj(path, 0, 1, 4)
    [s0] = load_model_kv_b_proj(path, 0, 1, 4, 0, 2)
    assert prepare("fp8", s0.weight, s0.scale).compute.dtype == torch.bfloat16  # its rows alone: exact
    assert full.compute.dtype == s0.compute.dtype == torch.float32
    assert same(s0, shard_kv_b_proj(full, 4, 0, 2))
    edit_tensor(path, scale_key(0), lambda s: torch.full_like(s, 2.0**-8))  # exact everywhere: bf16
    [s1] = load_model_kv_b_proj(path, 0, 1, 4, 1, 2)
    assert s1.compute.dtype == torch.bfloat16


def test_a_single_file_checkpoint(tmp_path, bf16_model):
    path = str(tmp_path / "one")
    write_model(path, TinyModel(layers=2, heads=4, shards=1, seed=5))
    os.rename(os.path.join(path, "model-00001-of-00001.safetensors"), os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    a = load_model_kv_b_proj(path, 0, 2, 4)
    b = load_model_kv_b_proj(bf16_model, 0, 2, 4)  # same seed: the same kv_b_proj
    assert all(same(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------- settings and flags


def settings_of(argv: list[str]) -> ServeSettings:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(argv))


def test_config_decides_what_flags_do_not(fp8_model, monkeypatch):
    s = settings_of(["--model", fp8_model])
    assert (s.heads, s.first_layer, s.layers) == (4, 0, 6)
    assert s.softmax_scale == pytest.approx(scale_formula(192, 40, 1.0))
    assert s.model == os.path.abspath(fp8_model)
    s = settings_of(["--model", fp8_model, "--first-layer", "2"])
    assert (s.first_layer, s.layers) == (2, 4)
    s = settings_of([])  # no --model: the built-in defaults
    assert (s.heads, s.first_layer, s.layers, s.softmax_scale, s.model) == (16, 0, 1, None, None)
    monkeypatch.setenv("CTXPREFILL_LAYERS", "2")  # the environment is explicit too
    assert settings_of(["--model", fp8_model]).layers == 2


def test_explicit_flags_override_config_and_say_so(fp8_model, caplog):
    caplog.set_level(logging.INFO, logger="ctxprefill")
    s = settings_of(["--model", fp8_model, "--heads", "4", "--layers", "2", "--first-layer", "1",
                     "--softmax-scale", "0.1"])
    assert (s.heads, s.first_layer, s.layers, s.softmax_scale) == (4, 1, 2, 0.1)
    msgs = {r.getMessage(): r.levelno for r in caplog.records}
    assert msgs["flag --layers 2 overrides config.json's num_hidden_layers (6)"] == logging.INFO
    assert msgs["flag --heads 4 overrides config.json's num_attention_heads (4)"] == logging.INFO  # agrees
    scale_line = [m for m in msgs if m.startswith("flag --softmax-scale 0.1 overrides config.json's softmax scale")]
    assert len(scale_line) == 1 and msgs[scale_line[0]] == logging.WARNING  # contradicts the model's own
    # --heads that disagrees with the weights' shape: refused at load, naming both
    s = settings_of(["--model", fp8_model, "--heads", "2", "--layers", "1"])
    with pytest.raises(ConfigError, match=r"kv_b_proj.weight has shape \[1024, 512\].*--heads 2 give \[512, 512\]"):
        build_engine(dataclasses.replace(s, device="cpu", num_blocks=4, block_size=16, workspace_tokens=64))


def test_model_and_weights_are_exclusive(fp8_model):
    with pytest.raises(ConfigError, match="--model and --weights are exclusive"):
        resolve_model(ServeSettings(model=fp8_model, weights="w.safetensors"))


SMALL = dict(device="cpu", block_size=16, num_blocks=8, workspace_tokens=64)


def test_engine_of_a_model_holds_its_layers_and_shards(fp8_model):
    s = resolve_model(ServeSettings(model=fp8_model, num_shards=2, shard_index=1, **SMALL), {"layers", "first_layer"})
    assert s.layers == 1  # explicit: the field's default
    s = resolve_model(ServeSettings(model=fp8_model, num_shards=2, shard_index=1, **SMALL))
    e = build_engine(dataclasses.replace(s, first_layer=4, layers=2))
    assert (e.config.shape.heads, e.config.first_layer, e.config.num_layers) == (2, 4, 2)
    assert e.config.shape.scale == pytest.approx(scale_formula(192, 40, 1.0))
    full = load_model_kv_b_proj(fp8_model, 4, 2, 4)
    for f, w in zip(full, e.layer_weights, strict=True):
        assert same(w, shard_kv_b_proj(f, 4, 1, 2))


# ------------------------------------------------------------------------- bad directories


def _no_config(p):
    os.remove(os.path.join(p, "config.json"))


def _bad_json(p):
    with open(os.path.join(p, "config.json"), "w") as f:
        f.write("{not json")


def _no_index(p):
    os.remove(os.path.join(p, "model.safetensors.index.json"))


def _missing_shard(p):
    os.remove(os.path.join(p, index_of(p)[weight_key(1)]))


def _missing_tensor(p):
    wm = index_of(p)
    del wm[weight_key(1)]
    with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)


def _missing_scale(p):
    wm = index_of(p)
    del wm[scale_key(0)]
    with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)


def _nan_fp8(p):  # 0x7F is e4m3's NaN: NaN after dequantization
    def poison(t):
        u = t.view(torch.uint8).clone()
        u[300, 7] = 0x7F
        return u.view(FP8)
    edit_tensor(p, weight_key(1), poison)


def _inf_scale(p):
    edit_tensor(p, scale_key(0), lambda s: torch.where(torch.arange(s.numel()).reshape(s.shape) == 5,
                                                       torch.tensor(float("inf")), s))


def _wrong_shape(p):
    edit_tensor(p, weight_key(0), lambda t: t[:512].contiguous())


def _wrong_scale_shape(p):
    edit_tensor(p, scale_key(0), lambda s: s[:3].contiguous())


def _not_fp8_in_config(p):
    edit_config(p, quantization_config=...)


def _write(p, name, text):
    with open(os.path.join(p, name), "w") as f:
        f.write(text)


def _corrupt_shard(p):
    with open(os.path.join(p, index_of(p)[weight_key(1)]), "wb") as f:
        f.write(b"\xff" * 64)


def _one_layer_bf16(p):
    edit_tensor(p, weight_key(1), lambda t: t.to(torch.bfloat16))


BAD_DIRS = [
    (_no_config, r"no config.json in it"),
    (_bad_json, r"config.json is not readable JSON"),
    (lambda p: edit_config(p, kv_lora_rank=...), r"config.json has no kv_lora_rank: .* not a DeepSeek-V2/V3"),
    (lambda p: edit_config(p, qk_rope_head_dim=32), r"config.json's qk_rope_head_dim is 32; the kernels serve "
                                                    r"qk_rope_head_dim 64"),
    (lambda p: edit_config(p, kv_lora_rank=256), r"config.json's kv_lora_rank is 256"),
    (lambda p: edit_config(p, v_head_dim=192), r"config.json's v_head_dim is 192"),
    (lambda p: edit_config(p, num_attention_heads=0), r"config.json's num_attention_heads must be an integer >= 1"),
    (lambda p: edit_config(p, quantization_config={"quant_method": "awq"}),
     r"quantization_config.quant_method 'awq' is not supported"),
    (lambda p: edit_config(p, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}),
     r"quantization_config.weight_block_size is \[64, 64\]"),
    (lambda p: edit_config(p, rope_scaling={"type": "yarn", "mscale_all_dim": 1.0}), r"rope_scaling .* has no factor"),
    (_no_index, r"neither model.safetensors.index.json nor model.safetensors"),
    (_missing_shard, r"model-0000\d-of-00006.safetensors \(named by model.safetensors.index.json\) does not exist"),
    (_missing_tensor, r"no tensor 'model.layers.1.self_attn.kv_b_proj.weight' \(layer 1\)"),
    (_missing_scale, r"no tensor 'model.layers.0.self_attn.kv_b_proj.weight_scale_inv' \(layer 0\)"),
    (_nan_fp8, r"layer 1's model.layers.1.self_attn.kv_b_proj.weight holds 1 NaN/Inf value\(s\), the first at "
               r"\[300, 7\] after dequantization"),
    (_inf_scale, r"layer 0's model.layers.0.self_attn.kv_b_proj.weight_scale_inv holds scales that are not finite"),
    (_wrong_shape, r"kv_b_proj.weight has shape \[512, 512\]; config.json \(num_attention_heads 4"),
    (_wrong_scale_shape, r"weight_scale_inv has shape \[3, 4\], expected \[8, 4\]"),
    (_not_fp8_in_config, r"is F8_E4M3 but config.json has no quantization_config"),
    (lambda p: _write(p, "config.json", "[1, 2]"), r"config.json must hold a JSON object"),
    (lambda p: edit_config(p, rope_scaling="yarn"),
     r"config.json's rope_scaling must be an object or null, got 'yarn'"),
    (lambda p: edit_config(p, rope_scaling={"type": "yarn", "factor": "40", "mscale_all_dim": 1.0}),
     r"config.json's rope_scaling.factor must be a finite number, got '40'"),
    (lambda p: edit_config(p, num_nextn_predict_layers=-1),
     r"config.json's num_nextn_predict_layers must be an integer >= 0, got -1"),
    (lambda p: edit_config(p, quantization_config="fp8"), r"config.json's quantization_config must be an object"),
    (lambda p: edit_config(p, quantization_config={"quant_method": "fp8", "fmt": "e5m2",
                                                   "weight_block_size": [128, 128]}),
     r"quantization_config.fmt 'e5m2' is not supported"),
    (lambda p: _write(p, "model.safetensors.index.json", '{"metadata": {}}'), r"has no weight_map object"),
    (lambda p: _write(p, "model.safetensors.index.json", "[1]"), r"index.json is not a readable JSON object"),
    (_corrupt_shard, r"model-0000\d-of-00006.safetensors is not a readable safetensors file"),
    (lambda p: edit_tensor(p, weight_key(0), lambda t: t.float()),
     r"model.layers.0.self_attn.kv_b_proj.weight has dtype F32; BF16 or F8_E4M3 expected"),
    (lambda p: edit_tensor(p, scale_key(0), lambda t: t.to(torch.int32)),
     r"model.layers.0.self_attn.kv_b_proj.weight_scale_inv has dtype I32; F32, BF16, F16 expected"),
    (lambda p: edit_tensor(p, weight_key(0), lambda t: t.reshape(2, -1, t.shape[1]).contiguous()),
     r"weight has shape \[2, 512, 512\]; a 2-D \[out, in\] weight is expected"),
    (_one_layer_bf16, r"the layers' kv_b_proj weights differ in dtype \(bf16, fp8\)"),
]


@pytest.mark.parametrize("damage,message", BAD_DIRS, ids=[m.split(" ")[0][:24] + str(i) for i, (_, m) in
                                                           enumerate(BAD_DIRS)])
def test_bad_directory_is_a_config_error_naming_the_problem(tmp_path, fp8_model, damage, message):
    path = copy_of(fp8_model, tmp_path / "m")
    damage(path)
    with pytest.raises(ConfigError, match=message):
        s = resolve_model(ServeSettings(model=path, **SMALL))
        load_model_kv_b_proj(s.model, s.first_layer, s.layers, s.heads)


def test_nan_or_inf_in_bf16_weights_is_refused(tmp_path, bf16_model):
    path = copy_of(bf16_model, tmp_path / "m")
    edit_tensor(path, weight_key(2), lambda t: t.index_put((torch.tensor([9]), torch.tensor([3])),
                                                           torch.tensor(float("inf"), dtype=t.dtype)))
    load_model_kv_b_proj(path, 0, 2, 4)  # layers 0 and 1 are fine
    with pytest.raises(ConfigError, match=r"layer 2's model.layers.2.self_attn.kv_b_proj.weight holds 1 NaN/Inf "
                                          r"value\(s\), the first at \[9, 3\]"):
        load_model_kv_b_proj(path, 0, 3, 4)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_nan_in_a_weights_file_is_refused(tmp_path, dtype):
    t = random_kv_b_proj(ModelShape(heads=2), dtype, 0)
    w = t["kv_b_proj.weight"]
    u = w.view(torch.uint8) if dtype == "fp8" else w.view(torch.int16)
    u[5, 6] = 0x7F if dtype == "fp8" else 0x7FC0  # NaN in e4m3 / bf16
    path = str(tmp_path / "w.safetensors")
    save_file({f"model.layers.3.self_attn.{k}": v for k, v in t.items()}, path)
    with pytest.raises(ConfigError, match=r"model.layers.3.self_attn.kv_b_proj.weight holds 1 NaN/Inf value\(s\), "
                                          r"the first at \[5, 6\]"):
        load_kv_b_proj(path, ModelShape(heads=2), "model.layers.3.self_attn.")


def test_serve_with_a_bad_model_exits_2_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CFG, "qk_rope_head_dim": 32}))
    for bad, needle in ((str(tmp_path / "missing"), "no such directory"), (str(tmp_path), "qk_rope_head_dim")):
        r = subprocess.run([sys.executable, "-m", "ctxprefill.cli", "serve", "--model", bad, "--device", "cpu",
                            "--port", "0", "--metrics-port", "0"], cwd=ROOT, env=env_with_sources(),
                           capture_output=True, text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert lines[0].startswith("ctxprefill: configuration error: ")


# ------------------------------------------------------------------------- make-model, end to end


#: DeepseekV3ForCausalLM's tensors of one layer, with transformers' shapes (modeling_deepseek_v3.py):
#: hidden h, heads H, q_lora_rank q, intermediate i
def layer_shapes(h: int, H: int, q: int, i: int) -> dict[str, tuple[int, ...]]:
    return {"input_layernorm.weight": (h,), "self_attn.q_a_proj.weight": (q, h), "self_attn.q_a_layernorm.weight": (q,),
            "self_attn.q_b_proj.weight": (H * (P + R), q), "self_attn.kv_a_proj_with_mqa.weight": (L + R, h),
            "self_attn.kv_a_layernorm.weight": (L,), "self_attn.kv_b_proj.weight": (H * (P + V), L),
            "self_attn.o_proj.weight": (h, H * V), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_make_model_writes_the_published_layout(tmp_path, dtype, capsys):
    path = str(tmp_path / "m")
    argv = ["make-model", path, "--layers", "2", "--heads", "2", "--dtype", dtype, "--shards", "3", "--seed", "4"]
    assert main(argv + ["--yarn"]) == 0
    assert "wrote" in capsys.readouterr().out
    files = sorted(os.listdir(path))
    assert files == ["config.json"] + [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json"]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2 and cfg["num_attention_heads"] == 2
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["tie_word_embeddings"] is False
    h, q, i, vocab = cfg["hidden_size"], cfg["q_lora_rank"], cfg["intermediate_size"], cfg["vocab_size"]
    want = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for layer in range(2):
        want |= {f"model.layers.{layer}.{k}": s for k, s in layer_shapes(h, 2, q, i).items()}
    got, dtypes = {}, {}
    for name, file in index_of(path).items():
        with safe_open(os.path.join(path, file), framework="pt") as f:
            t = f.get_tensor(name)
            assert f.metadata() == {"format": "pt"}
        got[name], dtypes[name] = tuple(t.shape), t.dtype
    linears = {k for k, s in want.items() if len(s) == 2 and ".layers." in k}
    if dtype == "bf16":
        assert "quantization_config" not in cfg
        assert got == want and set(dtypes.values()) == {torch.bfloat16}
    else:
        assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}
        scales = {k.removesuffix(".weight") + ".weight_scale_inv": (math.ceil(want[k][0] / 128),
                                                                    math.ceil(want[k][1] / 128)) for k in linears}
        assert got == want | scales
        assert all(dtypes[k] == FP8 for k in linears) and all(dtypes[k] == torch.float32 for k in scales)
        assert all(dtypes[k] == torch.bfloat16 for k in want if k not in linears)
    assert main(argv) == 2  # the directory is not empty any more
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_served_model_reports_itself(tmp_path, monkeypatch):
    """make-model -> serve --model (in-process) -> GetServerInfo; the layers compute with the weights of
    random seed + layer, exactly what a server of random weights of that seed computes."""
    import inprocess_service  # the service layer: only this test needs it

    path = str(tmp_path / "m")
    assert main(["make-model", path, "--layers", "3", "--heads", "2", "--dtype", "fp8", "--shards", "2",
                 "--seed", "7", "--yarn"]) == 0
    s = settings_of(["--model", path, "--first-layer", "1", "--device", "cpu", "--block-size", "16",
                     "--num-blocks", "8", "--workspace-tokens", "64"])
    engine = build_engine(s)
    monkeypatch.setattr(inprocess_service, "SETTINGS", s)

    async def info():
        async with inprocess_service.Harness(engine) as h:
            return await h.stub.GetServerInfo(pb.GetServerInfoRequest())

    i = asyncio.run(info())
    assert (i.num_layers, i.first_layer, i.num_heads, i.total_heads) == (2, 1, 2, 2)
    assert i.softmax_scale == pytest.approx(scale_formula(192, 40, 1.0), rel=1e-15)
    assert i.weights_source == os.path.abspath(path)
    assert (i.kv_b_proj_dtype, i.kv_b_proj_scale_format) == ("fp8", "block")
    rnd = build_engine(ServeSettings(heads=2, seed=7, kv_b_proj_dtype="fp8", first_layer=1, layers=2, **SMALL))
    for a, b in zip(engine.layer_weights, rnd.layer_weights, strict=True):
        assert same(a, b)
