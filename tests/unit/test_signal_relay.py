"""The agent's signal handler takes no lock (agent/signal_relay.py).

Python runs a handler in the main thread between two bytecodes. The agent's reaction
sets threading.Events whose plain Lock the main thread holds for a moment after each
timed wait on them; a handler run in that moment used to wait for that Lock, held by
its own thread, forever (seen in a chaos soak: an agent given a spot notice while its
workers re-formed never left). The critical moment is reproduced by holding the Lock
in the thread that calls the handler.
"""

from __future__ import annotations

import signal
import threading
import time

from elastic_runner.agent.signal_relay import SignalRelay
from tests.unit.test_agent import Node


def call_holding(lock, handler, signum: int) -> threading.Thread:
    """`handler(signum)` from a thread that holds `lock`, as the interrupted main
    thread would; the thread is returned so that a deadlock shows as a live thread."""
    def interrupted() -> None:
        with lock:
            handler(signum, None)

    thread = threading.Thread(target=interrupted, daemon=True)
    thread.start()
    thread.join(5)
    return thread


def test_the_reaction_runs_once_the_interrupted_thread_lets_go():
    lock, seen = threading.Lock(), []

    def react(signum: int) -> None:
        with lock:
            seen.append(signum)

    relay = SignalRelay(react)
    try:
        assert not call_holding(lock, relay.handler, signal.SIGTERM).is_alive()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
    finally:
        relay.close()
    relay.handler(signal.SIGTERM, None)  # after close: nothing written, nothing raised
    assert seen == [signal.SIGTERM]


def test_a_signal_landing_while_the_agent_holds_its_stop_event_stops_it(tmp_path):
    node = Node(tmp_path)
    names = [name.strip() for name in node.agent._job.signals_to_handle.split(",")]
    kept = {name: signal.getsignal(getattr(signal, name)) for name in names}
    try:
        node.agent.install_signal_handlers()
        handler = signal.getsignal(signal.SIGTERM)
        stop_event = node.agent._signal_seen
        assert not call_holding(stop_event._cond, handler, signal.SIGTERM).is_alive()
        assert stop_event.wait(5)
        assert node.agent._signal == signal.SIGTERM
    finally:
        for name, previous in kept.items():
            signal.signal(getattr(signal, name), previous)
        node.agent.close()


def test_a_failed_reaction_does_not_end_the_relay(caplog):
    seen = []

    def react(signum: int) -> None:
        seen.append(signum)
        if len(seen) == 1:
            raise RuntimeError("etcd went away")

    relay = SignalRelay(react)
    try:
        relay.handler(signal.SIGTERM, None)
        relay.handler(signal.SIGINT, None)
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM, signal.SIGINT]
        assert "handling signal 15 failed" in caplog.text
    finally:
        relay.close()
