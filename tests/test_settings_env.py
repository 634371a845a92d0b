"""Settings from the environment (CONTRACT §8): each flag's ``CTXPREFILL_<NAME>`` goes through the
flag's own type and choices; a value they refuse stops the parse with an error naming the variable.
Values the types allow but the server does not (limits, ports, the cache's size) are ConfigErrors
naming the flag."""

import argparse

import pytest

from ctxprefill.settings import ServeSettings, add_arguments, from_args


def settings(argv: list[str] | None = None) -> ServeSettings:
    p = argparse.ArgumentParser(prog="serve")
    add_arguments(p)  # reads the environment
    return from_args(p.parse_args(argv or []))


@pytest.mark.parametrize("name, value, message", [
    ("GENERIC", "maybe", "is not a boolean"),
    ("GENERIC", "", "is not a boolean"),
    ("REQUEST_RING", "2", "is not a boolean"),
    ("PORT", "50o51", "is not an integer"),
    ("HEADS", "2.5", "is not an integer"),
    ("K_SCALE", "one", "is not a number"),
    ("SOFTMAX_SCALE", "x", "is not a number"),
    ("CACHE_DTYPE", "fp16", "must be one of auto, fp8, fp8_ds_mla"),
    ("PREFILL_DTYPE", "int8", "must be one of bf16, fp8"),
    ("SHARED_MEMORY", "yes", "must be one of off, system, cuda, all"),
])
def test_bad_environment_values_are_refused_naming_the_variable(monkeypatch, capsys, name, value, message):
    monkeypatch.setenv(f"CTXPREFILL_{name}", value)
    with pytest.raises(SystemExit) as e:
        settings()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"CTXPREFILL_{name}={value!r} {message}" in err, err
    assert f"--{name.lower().replace('_', '-')}" in err  # and the flag it stands for


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("Yes", True), ("ON", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("Off", False),
])
def test_booleans_accept_the_usual_words(monkeypatch, value, expected):
    monkeypatch.setenv("CTXPREFILL_GENERIC", value)
    monkeypatch.setenv("CTXPREFILL_UNPACKED_KEYS", value)
    s = settings()
    assert s.generic is expected and s.unpacked_keys is expected


def test_good_values_are_typed(monkeypatch):
    for name, value in [("PORT", "6000"), ("HEADS", "8"), ("K_SCALE", "0.5"), ("SOFTMAX_SCALE", "0.125"),
                        ("CACHE_DTYPE", "fp8"), ("SHARED_MEMORY", "system"), ("HOST", "127.0.0.1")]:
        monkeypatch.setenv(f"CTXPREFILL_{name}", value)
    s = settings()
    assert (s.port, s.heads, s.k_scale, s.softmax_scale) == (6000, 8, 0.5, 0.125)
    assert (s.cache_dtype, s.shared_memory, s.host) == ("fp8", "system", "127.0.0.1")
    assert type(s.host) is str and type(s.cache_dtype) is str


def test_the_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("CTXPREFILL_PORT", "6000")
    monkeypatch.setenv("CTXPREFILL_GENERIC", "1")
    s = settings(["--port", "7000", "--no-generic"])
    assert (s.port, s.generic) == (7000, False)


def test_bad_flag_values_keep_argparse_messages(capsys):
    with pytest.raises(SystemExit):
        settings(["--cache-dtype", "fp16"])
    assert "argument --cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        settings(["--port", "x"])
    assert "argument --port: invalid int value: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize("changes, message", [
    (dict(grace_seconds=-1), "--grace-seconds must be >= 0, got -1"),
    (dict(grace_seconds=float("nan")), "--grace-seconds must be >= 0, got nan"),
    (dict(max_message_bytes=1 << 20), "--max-message-bytes must be in [4194304, 2147483647], got 1048576"),
    (dict(max_message_bytes=2**31), "--max-message-bytes must be in [4194304, 2147483647], got 2147483648"),
    (dict(queue_size=0), "--queue-size must be >= 1, got 0"),
    (dict(port=65536), "--port must be in [0, 65535], got 65536"),
    (dict(metrics_port=-1), "--metrics-port must be in [0, 65535], got -1"),
])
def test_the_servers_own_limits_are_checked_naming_the_flag(changes, message):
    from ctxprefill.errors import ConfigError
    from ctxprefill.settings import check_serve_settings

    check_serve_settings(ServeSettings())  # the defaults pass
    with pytest.raises(ConfigError) as e:
        check_serve_settings(ServeSettings(**changes))
    assert message in str(e.value)


@pytest.mark.parametrize("changes, message", [
    (dict(heads=0), "--heads must be an integer >= 1, got 0"),
    (dict(num_blocks=0), "--num-blocks must be an integer >= 1, got 0"),
    (dict(num_blocks=2**26, block_size=64), "--num-blocks × --block-size must stay below 2**31 slots"),
    (dict(kv_b_proj_dtype="int8"), "kv_b_proj dtype must be one of"),
    (dict(softmax_scale=0.0), "softmax scale must be finite and > 0, got 0.0"),
    (dict(softmax_scale=float("inf")), "softmax scale must be finite and > 0, got inf"),
    (dict(weights="/nonexistent/w.safetensors"), "--weights: no such file '/nonexistent/w.safetensors'"),
    (dict(backend="triton"), "--backend triton: attention backend 'triton' is not available"),
])
def test_the_engines_settings_are_checked_before_a_port_is_bound(changes, message):
    from ctxprefill.errors import ConfigError
    from ctxprefill.settings import check_engine_settings

    check_engine_settings(ServeSettings(device="cpu"))  # the defaults pass
    with pytest.raises(ConfigError) as e:
        check_engine_settings(ServeSettings(device="cpu", **changes))
    assert message in str(e.value)
