"""Worker interpreters started ahead of the rounds that need them (`--prewarm`).

Why: on the restart path every round starts fresh workers, and each spends its first
0.9-1.5 s here (seconds on a GPU node) importing torch while the whole job waits.
With --prewarm the agent keeps one interpreter per local worker that has already
imported torch (worker/prewarm.py) and hands it the script when a round starts: the
first round's workers import torch while the rendezvous runs, a restart's while the
previous round trained. Off by default: torch is imported before the script's first
line, so a script that sets a variable torch reads at import before importing it
sees a difference (worker/prewarm.py says which).

Once the workers re-form in place (`er.elastic`), they survive resizes, and a waiting
interpreter would only serve a fallback: the agent then lets them go (agent.py), and
starting standby workers (standby.py: the run re-forms in place) refills nothing.
Measured (bench/README): restarts gain what `import torch` costs; the in-process spot
replay does not, its newcomers' boot being the script's, not the launcher's.

A warm interpreter is used only when its environment, less the variables of the
worker contract (rank, world size, round: nothing torch reads at import), equals the
worker's; otherwise it is stopped and a fresh process started, as without --prewarm.
New ones start `refill_delay_s` after the last were taken (their imports would
otherwise compete with the starting workers for the CPU), on a thread that lives as
long as the agent (`refill_later` says why). Those never used are killed when the
agent ends; each also has the parent-death signal, and one whose agent vanished exits
at the end of its input.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from typing import Callable

from elastic_runner._process import bound_to_parent
from elastic_runner.contract import PREWARM_MODULE, PYTHON_ENTRY, contract_variables

log = logging.getLogger("elastic_runner")

REFILL_DELAY_S = 3.0


def warmable(argv: tuple[str, ...]) -> bool:
    """An entry point this module can start ahead: `python -u` and a script or -m."""
    return tuple(argv[:2]) == PYTHON_ENTRY and len(argv) > 2


def _import_env(env: dict[str, str]) -> dict[str, str]:
    """What a worker's interpreter may depend on when it imports torch."""
    contract = contract_variables()
    return {name: value for name, value in env.items() if name not in contract}


class WarmPool:
    """One waiting interpreter per local rank, started ahead of the next round."""

    def __init__(self, argv: tuple[str, ...], env_for: Callable[[int], dict[str, str]],
                 nproc: int, refill_delay_s: float = REFILL_DELAY_S):
        if not warmable(argv):
            raise ValueError("--prewarm needs a Python entry point (a script or -m MODULE)")
        self._entry = list(argv[2:])
        self._env_for = env_for
        self._nproc = nproc
        self._refill_delay_s = refill_delay_s
        self._lock = threading.Lock()
        self._asked = threading.Condition(self._lock)
        self._waiting: dict[int, tuple[subprocess.Popen, dict[str, str]]] = {}
        self._refill_due: float | None = None  # monotonic time of the next refill
        self._spawner: threading.Thread | None = None
        self._closed = False

    def fill(self) -> None:
        """Start an interpreter for every local rank that has none waiting."""
        with self._lock:
            if self._closed:
                return
            for local_rank in range(self._nproc):
                if local_rank not in self._waiting:
                    env = self._env_for(local_rank)
                    self._waiting[local_rank] = (self._spawn(env), _import_env(env))

    def take(self, local_rank: int, env: dict[str, str]) -> subprocess.Popen | None:
        """The waiting interpreter of `local_rank`, now running the entry point with
        `env`; None when there is none fit for it (start a fresh process instead)."""
        with self._lock:
            waiting = self._waiting.pop(local_rank, None)
        if waiting is None:
            return None
        process, import_env = waiting
        if process.poll() is not None or import_env != _import_env(env):
            differ = sorted(k for k in set(import_env) | set(_import_env(env))
                            if import_env.get(k) != env.get(k))
            log.info("a waiting interpreter does not fit local rank %d (%s); starting a "
                     "fresh one", local_rank, f"exited {process.returncode}"
                     if process.poll() is not None else f"environment differs: {differ}")
            _let_go(process)
            return None
        order = json.dumps({"argv": self._entry, "env": env}) + "\n"
        try:
            process.stdin.write(order.encode())
            process.stdin.close()
        except OSError:  # it died between the poll and the write
            _let_go(process)
            return None
        return process

    def refill_later(self) -> None:
        """Start new interpreters after the delay (once, however often it is asked).

        On a thread that lives as long as the agent: a child's parent-death signal
        (_process.bound_to_parent) fires when the *thread* that started it ends, so a
        short-lived timer thread would kill what it started, workers included."""
        with self._lock:
            if self._closed or self._refill_due is not None:
                return
            self._refill_due = time.monotonic() + self._refill_delay_s
            if self._spawner is None:
                self._spawner = threading.Thread(target=self._refill_forever,
                                                 name="prewarm", daemon=True)
                self._spawner.start()
            self._asked.notify()

    def _refill_forever(self) -> None:
        while True:
            with self._lock:
                while self._refill_due is None or self._refill_due > time.monotonic():
                    wait = None if self._refill_due is None else \
                        self._refill_due - time.monotonic()
                    self._asked.wait(wait)
                self._refill_due = None
            try:
                self.fill()
            except Exception as error:  # noqa: BLE001 - this thread must outlive its children
                log.warning("--prewarm: could not start a waiting interpreter (%s); the next "
                            "workers start as without it", error)

    def close(self) -> None:
        """Stop every waiting interpreter; no new ones after this."""
        with self._lock:
            self._closed = True
            self._refill_due = None
            waiting, self._waiting = list(self._waiting.values()), {}
        for process, _ in waiting:
            _let_go(process)

    def _spawn(self, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            bound_to_parent([*PYTHON_ENTRY, "-m", PREWARM_MODULE]), env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)


def _let_go(process: subprocess.Popen) -> None:
    """End an interpreter that will not be used. A kill, not its end of input: one
    still importing torch would take a second to read it, and the caller is
    starting a round. It has done nothing and holds nothing."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10.0)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
