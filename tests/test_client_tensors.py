"""ctxprefill_client.tensors: exact bf16 / fp8 e4m3 casts (against torch, on every bit
pattern) and numpy <-> Tensor message encoding. The client itself never imports torch;
only these tests do, as the reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ctxprefill_api import pb
from ctxprefill_client import tensors as T

torch = pytest.importorskip("torch")

ALL_U16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _torch_bf16_bits(x32: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _torch_fp8_sat_bits(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _is_nan_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7FFF) > 0x7F80


def _is_nan_fp8(bits: np.ndarray) -> np.ndarray:
    return (bits & 0x7F) == 0x7F


def _special_f32() -> np.ndarray:
    u = [
        0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00008000, 0x00018000,
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F800000, 0xFF800000,
        0x7F800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800100, 0xFF810000,
        0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,
    ]  # fmt: skip
    return np.array(u, dtype=np.uint32).view(np.float32)


def _random_f32(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    # plus ties and near-ties at every exponent: low half exactly 0x8000, 0x7FFF, 0x8001
    hi = rng.integers(0, 1 << 16, size=n // 4, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi])
    normals = rng.standard_normal(n).astype(np.float32).view(np.uint32)
    return np.concatenate([bits, ties, normals]).view(np.float32)


# --------------------------------------------------------------------------- bf16


def test_bf16_to_float32_all_patterns_matches_torch():
    ours = T.bf16_bits_to_float32(ALL_U16)
    ref = torch.from_numpy(ALL_U16.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    assert ours.dtype == np.float32 and ours.shape == (65536,)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_bf16_round_trip_all_patterns():
    back = T.float32_to_bf16_bits(T.bf16_bits_to_float32(ALL_U16))
    nan = _is_nan_bf16(ALL_U16)
    assert nan.sum() == 254
    np.testing.assert_array_equal(back[~nan], ALL_U16[~nan])
    assert _is_nan_bf16(back[nan]).all()
    # sign and top payload bits of a NaN are kept (quiet bit set)
    np.testing.assert_array_equal(back[nan], ALL_U16[nan] | 0x0040)


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_to_bf16_matches_torch(seed):
    x = np.concatenate([_special_f32(), _random_f32(200_000, seed)])
    ours = T.float32_to_bf16_bits(x)
    ref = _torch_bf16_bits(x)
    nan = np.isnan(x)
    assert nan.any()
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert _is_nan_bf16(ours[nan]).all()
    assert _is_nan_bf16(ref[nan]).all()


def test_float32_to_bf16_ties_to_even():
    x = np.array([0x3F808000, 0x3F818000, 0xBF808000], dtype=np.uint32).view(np.float32)
    np.testing.assert_array_equal(T.float32_to_bf16_bits(x), np.array([0x3F80, 0x3F82, 0xBF80], np.uint16))


def test_float32_to_bf16_float64_input_goes_through_float32():
    x = np.array([1.0 + 2**-8 + 2**-30, 3.0, -2.5e-40])
    np.testing.assert_array_equal(T.float32_to_bf16_bits(x), _torch_bf16_bits(x.astype(np.float32)))


def test_bf16_shapes_and_strides_kept():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1)[::2]
    bits = T.float32_to_bf16_bits(x)
    assert bits.shape == x.shape and bits.dtype == np.uint16
    np.testing.assert_array_equal(T.bf16_bits_to_float32(bits), x)


# --------------------------------------------------------------------------- fp8


def test_fp8_decode_table_matches_torch():
    codes = np.arange(256, dtype=np.uint8)
    ours = T.fp8_e4m3_bits_to_float32(codes)
    ref = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(ref)
    assert nan.sum() == 2 and np.isnan(ours[nan]).all()
    np.testing.assert_array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.nanmax(ours) == 448.0 and np.nanmin(ours) == -448.0


def test_fp8_saturating_cast_all_bf16_patterns_matches_torch():
    x = T.bf16_bits_to_float32(ALL_U16)  # every bf16 value, as float32
    ours = T.float32_to_fp8_e4m3_bits(x)
    ref = _torch_fp8_sat_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert _is_nan_fp8(ours[nan]).all()
    assert not _is_nan_fp8(ours[~nan]).any()  # saturating: no NaN out of a non-NaN
    # saturation: +-inf and everything past 448 give +-448 (0x7E / 0xFE)
    big = ~nan & (np.abs(x) >= 448)
    np.testing.assert_array_equal(ours[big] & 0x7F, np.full(big.sum(), 0x7E, np.uint8))


def test_fp8_saturating_cast_all_fp16_patterns_matches_torch():
    x16 = ALL_U16.view(np.float16)
    ours = T.float32_to_fp8_e4m3_bits(x16)
    ref = _torch_fp8_sat_bits(x16)
    nan = np.isnan(x16)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert _is_nan_fp8(ours[nan]).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_saturating_cast_random_float32_matches_torch(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate(
        [
            _special_f32(),
            _random_f32(100_000, seed),
            (rng.standard_normal(100_000) * 100).astype(np.float32),
            (rng.standard_normal(100_000) * 2**-7).astype(np.float32),  # subnormal range of e4m3
        ]
    )
    ours = T.float32_to_fp8_e4m3_bits(x)
    ref = _torch_fp8_sat_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert _is_nan_fp8(ours[nan]).all()


def test_fp8_float64_input_rounds_once():
    # 1 + 2**-4 + 2**-40: a float32 cast would round it to the tie 1.0625 -> even (1.0);
    # rounded once from float64 it is above the tie -> 1.125.
    x = np.array([1 + 2**-4 + 2**-40, -(1 + 2**-4 + 2**-40)])
    np.testing.assert_array_equal(T.fp8_e4m3_bits_to_float32(T.float32_to_fp8_e4m3_bits(x)), [1.125, -1.125])


def test_fp8_round_trip_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    back = T.float32_to_fp8_e4m3_bits(T.fp8_e4m3_bits_to_float32(codes))
    nan = _is_nan_fp8(codes)
    np.testing.assert_array_equal(back[~nan], codes[~nan])
    assert _is_nan_fp8(back[nan]).all()


# ------------------------------------------------- ml_dtypes against the integer bit arithmetic
# The conversions go through ml_dtypes; these references are the same casts written as integer
# arithmetic on the bits, and every bf16 bit pattern (with each kind of low half for rounding)
# must give the same bits, NaN payloads included.


def _ref_float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    quiet = ((u >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), quiet, rounded)


def _ref_fp8_e4m3_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    code = bits.astype(np.int64)
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man * 2.0**-9, (8 + man) * np.exp2(exp - 10.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(sign == 1, -mag, mag).astype(np.float32)


def _ref_float32_to_fp8_e4m3_bits(x: np.ndarray) -> np.ndarray:
    work = np.float64 if x.dtype == np.float64 else np.float32
    a = np.abs(x.astype(work))
    is_nan = np.isnan(a)
    a = np.where(is_nan, 0.0, np.minimum(a, 448.0)).astype(work)
    _, e = np.frexp(a)  # a = f * 2**e, f in [0.5, 1)
    qexp = np.where(a == 0, -9, np.maximum(e.astype(np.int32) - 4, -9))  # quantum of the e4m3 grid at a
    k = np.rint(np.ldexp(a, -qexp))  # RNE to an integer multiple of the quantum
    code = np.where(is_nan, 0x7F, (qexp + 9) * 8 + k.astype(np.int32)).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << np.uint8(7))


def _every_bf16_pattern_with_low_halves() -> np.ndarray:
    hi = ALL_U16.astype(np.uint32) << np.uint32(16)
    lows = (0x0000, 0x0001, 0x3FFF, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF)  # below, at and above each tie
    return np.concatenate([hi | np.uint32(lo) for lo in lows]).view(np.float32)


def test_ml_dtypes_bf16_widening_equals_the_bit_shift_on_every_pattern():
    ours = T.bf16_bits_to_float32(ALL_U16).view(np.uint32)
    np.testing.assert_array_equal(ours, ALL_U16.astype(np.uint32) << np.uint32(16))


def test_ml_dtypes_bf16_rounding_equals_the_integer_rounding_on_every_pattern():
    x = _every_bf16_pattern_with_low_halves()
    assert np.isnan(x).sum() == 8 * 254 + 7 * 2  # ±inf with a nonzero low half is NaN; payloads compared too
    np.testing.assert_array_equal(T.float32_to_bf16_bits(x), _ref_float32_to_bf16_bits(x))


def test_ml_dtypes_fp8_widening_equals_the_table_on_every_code():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(T.fp8_e4m3_bits_to_float32(codes).view(np.uint32),
                                  _ref_fp8_e4m3_bits_to_float32(codes).view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_ml_dtypes_fp8_saturating_cast_equals_the_integer_rounding_on_every_pattern(dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        x = _every_bf16_pattern_with_low_halves().astype(dtype)
    ours = T.float32_to_fp8_e4m3_bits(x)
    np.testing.assert_array_equal(ours, _ref_float32_to_fp8_e4m3_bits(x))
    finite_big = np.isfinite(x) & (np.abs(x) > 448)
    assert finite_big.any() and ((ours[finite_big] & 0x7F) == 0x7E).all()  # clamped, never ml_dtypes' NaN


def test_ml_dtypes_fp8_float64_ties_round_once():
    grid = np.unique(np.abs(_ref_fp8_e4m3_bits_to_float32(np.arange(127, dtype=np.uint8)).astype(np.float64)))
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), -mids, mids * (1 + 2**-40)])
    np.testing.assert_array_equal(T.float32_to_fp8_e4m3_bits(x), _ref_float32_to_fp8_e4m3_bits(x))


# --------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    "arr, wire",
    [
        (np.arange(12, dtype=np.float32).reshape(3, 4) / 7, T.FP32),
        (np.arange(12, dtype=np.float16).reshape(2, 2, 3), T.FP16),
        (np.arange(-5, 5, dtype=np.int32), T.INT32),
        (np.arange(-5, 5, dtype=np.int64) * (1 << 40), T.INT64),
        (np.arange(256, dtype=np.uint8).reshape(16, 16), T.UINT8),
    ],
)
def test_encode_decode_round_trip(arr, wire):
    msg = T.encode_tensor(arr)
    assert msg.dtype == wire and list(msg.shape) == list(arr.shape)
    assert len(msg.data) == arr.size * arr.itemsize
    assert msg.data == np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
    back = T.tensor_to_numpy(msg)
    np.testing.assert_array_equal(back, arr)


def test_encode_bf16_and_fp8_from_floats_and_bits():
    x = np.array([[1.0, -2.5, 3.140625], [448.0, 1e6, -np.inf]], dtype=np.float32)
    m = T.encode_tensor(x, T.BF16, name="q")
    assert m.dtype == T.BF16 and len(m.data) == 12
    np.testing.assert_array_equal(T.decode_tensor(m).bits, T.float32_to_bf16_bits(x))
    np.testing.assert_array_equal(T.tensor_to_numpy(m), T.bf16_bits_to_float32(T.float32_to_bf16_bits(x)))
    bits = T.float32_to_bf16_bits(x)
    assert T.encode_tensor(bits, T.BF16).data == m.data
    assert T.encode_tensor(T.RawTensor(T.BF16, bits)).data == m.data
    f8 = T.encode_tensor(x, T.FP8_E4M3)
    np.testing.assert_array_equal(T.tensor_to_numpy(f8), [[1.0, -2.5, 3.25], [448.0, 448.0, -448.0]])


def test_encode_strided_and_big_endian_inputs():
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    view = base.transpose(1, 0, 2)[:, ::2, 1:4]
    msg = T.encode_tensor(view)
    np.testing.assert_array_equal(T.tensor_to_numpy(msg), view)
    be = np.arange(6, dtype=">i8")
    msg = T.encode_tensor(be, T.INT64)
    assert msg.data == np.arange(6, dtype="<i8").tobytes()


def test_decode_is_a_read_only_view_without_copy():
    arr = np.arange(1000, dtype=np.float32)
    msg = T.encode_tensor(arr)
    data = msg.data
    raw = T.decode_tensor(pb.Tensor(dtype=msg.dtype, shape=msg.shape, data=data))
    assert not raw.bits.flags.writeable
    # np.frombuffer: the array's memory is the message's bytes object itself, not a copy
    base = raw.bits
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes) and len(base) == 4000


def test_decode_rejects_length_mismatch_naming_the_field():
    msg = pb.Tensor(dtype=T.FP32, shape=[2, 3], data=b"\x00" * 20)
    with pytest.raises(ValueError, match=r"^kv_c: data has 20 bytes.*needs 24"):
        T.decode_tensor(msg, name="kv_c")
    with pytest.raises(ValueError, match="^lse: "):
        T.decode_tensor(pb.Tensor(dtype=T.BF16, shape=[4], data=b"\x00" * 4), name="lse")


def test_decode_rejects_bad_dtype_shape_and_ndim():
    with pytest.raises(ValueError, match="^q: unsupported dtype UNSPECIFIED"):
        T.decode_tensor(pb.Tensor(shape=[1], data=b"\x00"), name="q")
    with pytest.raises(ValueError, match="^q: negative dimension"):
        T.decode_tensor(pb.Tensor(dtype=T.UINT8, shape=[-1], data=b""), name="q")
    with pytest.raises(ValueError, match=r"^q: expected 3 dimensions"):
        T.decode_tensor(pb.Tensor(dtype=T.UINT8, shape=[1], data=b"\x00"), name="q", ndim=3)
    with pytest.raises(ValueError, match=r"^q: dtype FP32 not allowed \(expected BF16, FP8_E4M3\)"):
        T.decode_tensor(pb.Tensor(dtype=T.FP32, shape=[1], data=b"\x00" * 4), name="q", dtypes=(T.BF16, T.FP8_E4M3))


def test_empty_and_scalar_tensors():
    empty = T.encode_tensor(np.zeros((0, 7), dtype=np.float32))
    assert list(empty.shape) == [0, 7] and empty.data == b""
    assert T.tensor_to_numpy(empty).shape == (0, 7)
    scalar = T.encode_tensor(np.float32(2.5))
    assert list(scalar.shape) == [] and len(scalar.data) == 4
    assert T.tensor_to_numpy(scalar) == np.float32(2.5)


def test_encode_rejects_bad_combinations():
    with pytest.raises(ValueError, match="^x: cannot infer"):
        T.encode_tensor(np.zeros(3), name="x")  # float64: ambiguous
    with pytest.raises(ValueError, match="^slot_mapping: INT64 needs an integer array"):
        T.encode_tensor(np.zeros(3, np.float32), T.INT64, name="slot_mapping")
    with pytest.raises(ValueError, match="out of range"):
        T.encode_tensor(np.array([1 << 40]), T.INT32, name="b")
    with pytest.raises(ValueError, match="^q: BF16 needs"):
        T.encode_tensor(np.zeros(3, np.int32), T.BF16, name="q")
    with pytest.raises(ValueError, match="^q: FP8_E4M3 needs"):
        T.encode_tensor(np.zeros(3, np.int32), T.FP8_E4M3, name="q")
    with pytest.raises(ValueError, match="^x: FP32 needs a numeric array"):
        T.encode_tensor(np.array(["a"]), T.FP32, name="x")
    with pytest.raises(ValueError, match="^x: unsupported dtype <99>"):
        T.encode_tensor(np.zeros(3, np.int32), 99, name="x")
    with pytest.raises(ValueError, match="^q: RawTensor is BF16, asked for FP8_E4M3"):
        T.encode_tensor(T.RawTensor(T.BF16, np.zeros(3, np.uint16)), T.FP8_E4M3, name="q")
    with pytest.raises(ValueError, match="needs bits of dtype uint16"):
        T.RawTensor(T.BF16, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="numpy array"):
        T.RawTensor(T.BF16, [0, 1])
    with pytest.raises(ValueError, match="unsupported tensor dtype UNSPECIFIED"):
        T.storage_dtype(0)
    with pytest.raises(ValueError, match="bf16 bits must be an integer array"):
        T.bf16_bits_to_float32(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="fp8 bits must be an integer array"):
        T.fp8_e4m3_bits_to_float32(np.zeros(2, np.float32))


def test_integer_input_and_wider_bits_convert_as_documented():
    """Integer values to fp8 go through float64 (exact for these); bits given in a wider
    integer dtype are narrowed to the storage dtype; RawTensor.from_float rounds per dtype."""
    ints = np.array([0, 1, -3, 448, 1000])
    np.testing.assert_array_equal(T.float32_to_fp8_e4m3_bits(ints), T.float32_to_fp8_e4m3_bits(ints.astype(np.float64)))
    assert T.fp8_e4m3_bits_to_float32(T.float32_to_fp8_e4m3_bits(ints)).tolist() == [0, 1, -3, 448, 448]
    np.testing.assert_array_equal(T.bf16_bits_to_float32(np.array([0x3F80], np.int64)), [1.0])
    np.testing.assert_array_equal(T.fp8_e4m3_bits_to_float32(np.array([0x38], np.int32)), [1.0])
    r = T.RawTensor.from_float([1.0, 2.5], T.FP32)
    assert r.dtype_name == "FP32" and r.bits.dtype == np.float32 and r.to_numpy().tolist() == [1.0, 2.5]
    assert T.RawTensor.from_float([1.0], T.BF16).bits.tolist() == [0x3F80]


# --------------------------------------------------------------------------- cache slots


def _slots_by_loop(table, start: int, end: int, bs: int) -> list[int]:
    return [int(table[p // bs]) * bs + p % bs for p in range(start, end)]


@pytest.mark.parametrize(
    "table, bs",
    [
        ([0], 1),
        ([5, 2, 7, 0], 1),
        ([5, 2, 7, 0], 3),
        (np.random.default_rng(0).permutation(64)[:9].astype(np.int32), 16),
        (np.random.default_rng(1).permutation(1000)[:5].astype(np.uint16), 64),
        (np.array([1 << 30, 3], dtype=np.int32), 64),  # slots past int32: computed in int64
    ],
)
def test_slot_mapping_matches_a_loop(table, bs):
    n = len(table) * bs
    ranges = {(0, n), (0, 0), (n, n), (0, 1), (n - 1, n), (bs - 1, min(n, bs + 1)), (1, n), (n // 2, n), (0, n // 3)}
    for start, end in sorted(ranges):
        got = T.slot_mapping(table, start, end, bs)
        assert got.dtype == np.int64 and got.shape == (end - start,)
        assert got.tolist() == _slots_by_loop(table, start, end, bs), (start, end)


def test_slot_mapping_pieces_concatenate_to_the_whole():
    table, bs = [9, 4, 11, 2, 6], 8
    whole = T.slot_mapping(table, 0, 37, bs)
    pieces = np.concatenate([T.slot_mapping(table, a, min(37, a + 5), bs) for a in range(0, 37, 5)])
    np.testing.assert_array_equal(pieces, whole)
    # a numpy table, a table longer than the range needs, numpy integer bounds: the same slots
    np.testing.assert_array_equal(T.slot_mapping(np.array(table + [0, 1]), np.int64(0), np.int32(37), bs), whole)


def test_slot_mapping_empty_table():
    got = T.slot_mapping([], 0, 0, 16)
    assert got.dtype == np.int64 and got.shape == (0,)
    with pytest.raises(ValueError, match=r"^end=1 is past the block table: 0 blocks of 16 hold 0 positions"):
        T.slot_mapping([], 0, 1, 16)


def test_slot_mapping_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got 0"):
        T.slot_mapping([0, 1], 0, 1, 0)
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got -4"):
        T.slot_mapping([0, 1], 0, 1, -4)
    with pytest.raises(ValueError, match=r"^start must be >= 0, got -1"):
        T.slot_mapping([0, 1], -1, 1, 4)
    with pytest.raises(ValueError, match=r"^end must be >= start, got start=3 end=2"):
        T.slot_mapping([0, 1], 3, 2, 4)
    with pytest.raises(ValueError, match=r"^end=9 is past the block table: 2 blocks of 4 hold 8 positions"):
        T.slot_mapping([0, 1], 0, 9, 4)
    T.slot_mapping([0, 1], 0, 8, 4)  # the last position of the last block is fine
    with pytest.raises(ValueError, match=r"^block_table must be 1-D, got shape \[2, 1\]"):
        T.slot_mapping([[0], [1]], 0, 1, 4)
    with pytest.raises(ValueError, match=r"^block_table must hold integers, got float64"):
        T.slot_mapping([0.0, 1.0], 0, 1, 4)
    with pytest.raises(TypeError, match=r"^end must be an integer, got float"):
        T.slot_mapping([0, 1], 0, 1.0, 4)


# --------------------------------------------------------------------------- no torch


def test_client_imports_without_torch():
    client_dir = Path(__file__).resolve().parents[1] / "client"
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import ctxprefill_client
        import ctxprefill_client.aio, ctxprefill_client.client, ctxprefill_client.merge
        import ctxprefill_client.tensors, ctxprefill_client.examples.orchestrator
        from ctxprefill_api import pb as ctxprefill_pb2, pb_grpc as ctxprefill_pb2_grpc
        import numpy as np
        out, lse = ctxprefill_client.merge_partials(
            np.zeros((2, 1, 3), np.float32), np.zeros((1, 2), np.float32),
            np.ones((2, 1, 3), np.float32), np.zeros((1, 2), np.float32))
        assert np.allclose(out, 0.5)
        assert ctxprefill_client.float32_to_fp8_e4m3_bits(np.float32(1e9)) == 0x7E
        assert ctxprefill_client.slot_mapping([3, 1], 1, 4, 2).tolist() == [7, 2, 3]
        bad = [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        assert all(sys.modules[m] is None for m in bad), bad
        print("ok", ctxprefill_client.__version__)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(client_dir))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")
