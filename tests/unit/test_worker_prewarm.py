"""The --prewarm interpreter's imports (worker/prewarm.py), without starting one."""

from __future__ import annotations

import io
import sys

import pytest

from elastic_runner.worker import prewarm


@pytest.fixture
def imports(monkeypatch):
    """The modules main() imports, in order; torch._dynamo fails to import."""
    asked: list[str] = []

    def import_module(name: str):
        asked.append(name)
        if name == "torch._dynamo":
            raise ImportError("no dynamo in this build")
        return sys.modules.get(name)

    monkeypatch.setattr(prewarm.importlib, "import_module", import_module)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    return asked


def test_torch_then_dynamo_and_a_failing_dynamo_is_no_error(imports):
    prewarm.main()  # no order on stdin: the agent let it go, nothing runs
    assert imports == ["torch", "torch._dynamo"]
