"""Fault injection as data: a schedule of (step, fault) run against a live job.

A fault test then reads as a scenario: `run_schedule(job, [at_step(20,
stop_etcd(etcd, 1.5))])` instead of a string of sleeps. Steps come from the
workers' own logs, so a fault lands at the same training point on any machine.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Fault:
    name: str
    action: Callable[[], None]


@dataclass(frozen=True)
class Scheduled:
    step: int
    fault: Fault


@dataclass(frozen=True)
class Fired:
    name: str
    step: int
    time: float


def at_step(step: int, fault: Fault) -> Scheduled:
    return Scheduled(step, fault)


def kill(job, node: str) -> Fault:
    return Fault(f"SIGKILL {node}", lambda: job.kill(node))


def terminate(job, node: str) -> Fault:
    return Fault(f"SIGTERM {node}", lambda: job.terminate(node))


def start(job, node: str, **flags) -> Fault:
    return Fault(f"start {node}", lambda: job.start(node, **flags))


def stop_etcd(server, seconds: float) -> Fault:
    """Stop etcd (SIGTERM), keep its data dir, start it again after `seconds`."""
    def action() -> None:
        server.stop()
        threading.Timer(seconds, server.start).start()
    return Fault(f"etcd down {seconds:g} s", action)


def kill_process(server) -> Fault:
    return Fault("SIGKILL etcd member", server.kill)


def partition(namespace: str, interface: str, seconds: float) -> Fault:
    """Take a namespace's veth down, and up again after `seconds`."""
    def set_link(state: str) -> None:
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", interface, state],
                       check=True)

    def action() -> None:
        set_link("down")
        threading.Timer(seconds, set_link, args=("up",)).start()
    return Fault(f"partition {namespace} {seconds:g} s", action)


def run_schedule(job, schedule: list[Scheduled], timeout: float = 120.0,
                 step_of=lambda job: max((r["step"] for r in job.steps()), default=-1)
                 ) -> list[Fired]:
    """Fire each fault when the job's highest logged step reaches its step."""
    fired: list[Fired] = []
    deadline = time.monotonic() + timeout
    for item in sorted(schedule, key=lambda s: s.step):
        job.wait_for(lambda: step_of(job) >= item.step or None,
                     max(deadline - time.monotonic(), 1), f"step {item.step}")
        item.fault.action()
        fired.append(Fired(item.fault.name, step_of(job), time.time()))
    return fired
