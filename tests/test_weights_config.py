"""Weights from safetensors (CONTRACT §8) and configuration checks that refuse to start."""

import pytest
import torch
from safetensors.torch import save_file

from ctxprefill.cli import main
from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.errors import ConfigError
from ctxprefill.weights import dequantize, load_kv_b_proj, random_kv_b_proj

SHAPE = ModelShape(heads=3)  # N = 768: six 128-row blocks; L = 512: four


@pytest.mark.parametrize("dtype,kind", [("bf16", "block"), ("fp8", "block"), ("fp8", "tensor")])
def test_make_weights_round_trip(tmp_path, dtype, kind):
    path = str(tmp_path / "w.safetensors")
    prefix = "model.layers.7.self_attn."
    assert main(["make-weights", "--out", path, "--heads", "3", "--dtype", dtype, "--scale-kind", kind,
                 "--prefix", prefix, "--seed", "3"]) == 0
    w = load_kv_b_proj(path, SHAPE, prefix)
    t = random_kv_b_proj(SHAPE, dtype, 3, kind)
    assert w.dtype == dtype
    assert torch.equal(w.weight.view(torch.uint8), t["kv_b_proj.weight"].view(torch.uint8))
    if dtype == "fp8":
        key = "kv_b_proj.weight_scale_inv" if kind == "block" else "kv_b_proj.weight_scale"
        assert torch.equal(w.scale.reshape(t[key].shape), t[key])
        if kind == "block":
            assert w.scale.shape == (6, 4)
        # W_deq approximates the original N(0, 1/L) weight within e4m3 precision
        assert (w.compute.float() - dequantize(w.weight, w.scale)).abs().max() == 0


def test_block_dequantization_uses_the_right_block():
    weight = torch.ones((200, 300)).to(torch.float8_e4m3fn)  # ragged edge blocks
    scale = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)
    d = dequantize(weight, scale)
    assert d[0, 0] == 1 and d[0, 299] == 3 and d[199, 0] == 4 and d[127, 128] == 2 and d[128, 256] == 6


def test_weights_errors_name_the_problem(tmp_path):
    p = str(tmp_path / "w.safetensors")
    save_file({"other.weight": torch.zeros(2, 2)}, p)
    with pytest.raises(ConfigError, match="no tensor 'kv_b_proj.weight'"):
        load_kv_b_proj(p, SHAPE)
    save_file({"kv_b_proj.weight": torch.zeros(10, 512, dtype=torch.bfloat16)}, p)
    with pytest.raises(ConfigError, match=r"expected \[768, 512\]"):
        load_kv_b_proj(p, SHAPE)
    save_file({"kv_b_proj.weight": torch.zeros(768, 512).to(torch.float8_e4m3fn)}, p)
    with pytest.raises(ConfigError, match="needs kv_b_proj.weight_scale_inv"):
        load_kv_b_proj(p, SHAPE)
    save_file({"kv_b_proj.weight": torch.zeros(768, 512).to(torch.float8_e4m3fn),
               "kv_b_proj.weight_scale_inv": torch.ones(3, 3)}, p)
    with pytest.raises(ConfigError, match=r"expected \[6, 4\]"):
        load_kv_b_proj(p, SHAPE)
    with pytest.raises(ConfigError, match="no such file"):
        load_kv_b_proj(str(tmp_path / "missing"), SHAPE)
    fp8 = torch.zeros(768, 512).to(torch.float8_e4m3fn)
    for extra, message in (
        ({"kv_b_proj.weight_scale": torch.ones(2)}, r"kv_b_proj.weight_scale must be a scalar, has shape \(2,\)"),
        ({"kv_b_proj.weight_scale": torch.tensor(0.0)}, "scales must be finite and positive"),
        ({"kv_b_proj.weight_scale_inv": torch.full((6, 4), float("inf"))}, "scales must be finite and positive"),
    ):
        save_file({"kv_b_proj.weight": fp8, **extra}, p)
        with pytest.raises(ConfigError, match=message):
            load_kv_b_proj(p, SHAPE)
    save_file({"kv_b_proj.weight": torch.zeros(768, 512)}, p)  # float32
    with pytest.raises(ConfigError, match="has dtype torch.float32; bf16 or float8_e4m3fn expected"):
        load_kv_b_proj(p, SHAPE)
    save_file({"model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(768, 512, dtype=torch.bfloat16)}, p)
    with pytest.raises(ConfigError, match=r"it holds \['model.layers.3.self_attn.kv_b_proj.weight'\]: set "
                                          r"--weights-prefix to the part before kv_b_proj.weight"):
        load_kv_b_proj(p, SHAPE)


def test_weights_file_is_never_unpickled(tmp_path):
    p = tmp_path / "w.safetensors"
    p.write_bytes(b"\x80\x04K\x01.")  # a pickle, not safetensors
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        load_kv_b_proj(str(p), SHAPE)


@pytest.mark.parametrize(
    "make, msg",
    [
        (
            lambda: EngineConfig(cache=CacheConfig("fp8", k_scale=0.5), prefill_dtype="fp8"),
            "exact only with --k-scale 1.0",
        ),
        (lambda: CacheConfig("fp16"), "--cache-dtype"),
        (lambda: CacheConfig(block_size=0), "--block-size"),
        (lambda: CacheConfig(k_scale=float("nan")), "--k-scale"),
        (lambda: ModelShape(heads=0), "--heads"),
        (lambda: ModelShape(kv_lora_rank=256), r"only L=512, P=128, R=64, V=128 .* got \(256, 128, 64, 128\)"),
        (lambda: ModelShape(v_head_dim=192), r"got \(512, 128, 64, 192\)"),
        (lambda: EngineConfig(cache=CacheConfig(block_size=64), workspace_tokens=32), "--workspace-tokens"),
        (lambda: EngineConfig(prefill_dtype="fp16"), "--prefill-dtype"),
    ],
)
def test_config_refuses_bad_settings(make, msg):
    with pytest.raises(ConfigError, match=msg):
        make()


def test_fp8_prefill_on_fp8_cache_with_unit_scale_is_fine():
    assert EngineConfig(cache=CacheConfig("fp8", k_scale=1.0), prefill_dtype="fp8").gather_raw_fp8


def test_serve_refuses_to_start_with_a_clear_message(capsys):
    rc = main(["demo", "--device", "cpu", "--cache-dtype", "fp8", "--prefill-dtype", "fp8", "--k-scale", "2"])
    assert rc == 2
    assert "--k-scale 1.0" in capsys.readouterr().err


def test_unpacked_keys_flag_reaches_the_engine(monkeypatch):
    """`serve --no-unpacked-keys` (or CTXPREFILL_UNPACKED_KEYS=0) turns the fused path's
    unpacked keys off; by default they are on (docs/DESIGN.md "Unpacked keys")."""
    import argparse

    from ctxprefill.app import build_engine
    from ctxprefill.settings import ServeSettings, add_arguments, from_args

    def engine(argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return build_engine(from_args(p.parse_args(["--device", "cpu", "--heads", "1", "--num-blocks", "4",
                                                    "--workspace-tokens", "64", "--backend", "reference", *argv])))

    assert ServeSettings().unpacked_keys is True
    assert engine([]).config.unpacked_keys is True
    assert engine(["--no-unpacked-keys"]).config.unpacked_keys is False
    assert engine(["--unpacked-keys"]).config.unpacked_keys is True
    monkeypatch.setenv("CTXPREFILL_UNPACKED_KEYS", "0")
    assert engine([]).config.unpacked_keys is False
    assert engine(["--unpacked-keys"]).config.unpacked_keys is True  # the flag wins over the environment
