"""Settings from the environment (CONTRACT §8): each flag's ``CTXPREFILL_<NAME>`` goes through the
flag's own type and choices; a value they refuse stops the parse with an error naming the variable."""

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
