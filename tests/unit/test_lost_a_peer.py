"""failures.lost_a_peer: which worker failures are victims of another's crash, from the
words torch and its backends actually print (the gloo line is from a run here)."""

from __future__ import annotations

import pytest

from elastic_runner.rendezvous.failures import lost_a_peer


def failure(tail=(), error=None, signal=None, stalled_s=None) -> dict:
    return {"exit_code": -9 if signal else 1, "signal": signal, "stalled_s": stalled_s,
            "stderr_tail": list(tail), "error": error}


@pytest.mark.parametrize("last_words", [
    "[rank2]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
    "553] Connection closed by peer [127.0.0.1]:11156. This is typically caused by a remote "
    "worker crashing.",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error "
    "[127.0.0.1]:5301: Connection reset by peer",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
    "waiting 30000ms for recv operation to complete",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote "
    "process exited or there was a network error, NCCL version 2.21.5",
    "torch.distributed.DistNetworkError: failed to recv, got 0 bytes",
])
def test_a_worker_whose_collective_lost_a_peer_is_a_victim(last_words):
    assert lost_a_peer(failure(["Traceback (most recent call last):", last_words]))
    assert lost_a_peer(failure(error=last_words))  # from torch's error file instead


@pytest.mark.parametrize("case", [
    failure(["SystemExit: injected failure at step 3 on rank 3"]),
    failure(["RuntimeError: Tensors must be CPU and dense"]),  # names no peer
    failure(["torch.OutOfMemoryError: CUDA out of memory."]),
    failure(error="ValueError: bad batch"),
    failure(),  # nothing said at all
    failure(signal="SIGKILL"),  # the OOM killer, a reaper: this worker itself
    failure(["...Connection closed by peer..."], signal="SIGSEGV"),
    failure(["...Connection closed by peer..."], stalled_s=30.0),  # a hang is a cause
])
def test_anything_else_is_a_cause(case):
    assert not lost_a_peer(case)


def test_only_the_last_words_count():
    """A peer lost and recovered long before (a warning early in the log) is no alibi."""
    early = "[W] gloo: Connection reset by peer, retrying"
    assert not lost_a_peer(failure([early, "x", "y", "Traceback...", "KeyError: 'w'"]))
