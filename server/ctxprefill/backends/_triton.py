"""Triton, imported once for the backends that compile kernels with it (triton_attention,
cudnn_frontend's metadata kernel). They stay importable where Triton is absent and
report ``TRITON_ERR`` as the reason they are unavailable."""

__all__ = ["TRITON_ERR", "tl", "triton"]

try:
    import triton
    import triton.language as tl

    TRITON_ERR = ""
except Exception as e:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    TRITON_ERR = f"triton is not importable: {e!r}"
