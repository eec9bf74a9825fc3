"""Hold every checkpoint write until the test says so: 'submitted' vs 'durable'."""

from __future__ import annotations

import threading

from elastic_runner.worker.checkpoint import storage as checkpoint_storage


def gate_storage_writes(monkeypatch) -> threading.Event:
    """Writes block until the returned event is set (or fail the test after 30 s)."""
    gate, original = threading.Event(), checkpoint_storage._write_all

    def gated(fileobj, data):
        assert gate.wait(30), "the test never opened the gate"
        original(fileobj, data)

    monkeypatch.setattr(checkpoint_storage, "_write_all", gated)
    return gate
