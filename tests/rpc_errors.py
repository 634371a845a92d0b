"""``expect(code, *fields)``: pytest.raises for a client error with a status code whose
details name every given field (the service's refusals name the field at fault)."""

from __future__ import annotations

import grpc
import pytest

from ctxprefill_client import CtxPrefillRpcError


def expect(code: grpc.StatusCode, *fields: str):
    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(CtxPrefillRpcError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            e = self.info.value
            assert e.code == code, f"expected {code.name}, got {e}"
            for f in fields:
                assert f in e.details, f"{f!r} not named in {e.details!r}"
            return handled

    return _Check()
