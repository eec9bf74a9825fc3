"""What the agent needs from its collaborators, written down as Protocols.

Why: the agent's decisions (which notice wins, when to drain, which exit code) are
worth testing without etcd or processes. The agent only ever calls the methods
below, so a test hands it a fake rendezvous and a fake worker group; production
hands it `EtcdRendezvous` (rendezvous/engine.py) and `WorkerGroup.start`
(workers.py), both of which satisfy these Protocols structurally.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from elastic_runner.agent.workers import WorkerExit
    from elastic_runner.config import WorkerConfig
    from elastic_runner.contract import WorkerEnv
    from elastic_runner.rendezvous.engine import RoundView
    from elastic_runner.rendezvous.protocol import Cause, Plan


class Rendezvous(Protocol):
    """The rounds of one run as one node sees them (EtcdRendezvous in production)."""

    def register(self, unless_in_place: bool = False) -> bool:
        """Check the job spec and announce this node (under its lease); True once
        announced. With `unless_in_place`, a node of a run whose workers re-form in
        place is not announced yet (False): its workers start on standby first, then
        register() is called again (standby.py)."""

    def leave(self) -> None:
        """Withdraw this node at once, so the others re-form without waiting."""

    def origin(self) -> str:
        """Which launch of the run id this is (its workers' checkpoint manifests say)."""

    def ping(self, write: bool = False) -> None:
        """Raise EtcdUnavailable while the store does not answer; with `write`, also
        EtcdFull while it refuses writes."""

    def etcd_answers_now(self) -> bool:
        """One request, not retried: does the store answer at this moment?"""

    def current_round(self) -> RoundView | None: ...

    def next_plan(self, previous: Plan | None, cause: Cause, rejoin: bool = True) -> Plan:
        """Block until a round that includes this node closes; raise ShutdownRequested
        after interrupt(), WorkerFailure/RunFinished when the run ended, LeaseLost
        when this node's lease is gone and `rejoin` is False (else it registers again)."""

    def change_reason(self, plan: Plan) -> Cause | None:
        """Why `plan`'s workers must stop now, or None while it holds."""

    def suspect(self, plan: Plan, cause: Cause) -> None:
        """Open the round after `plan` now: a local worker saw a collective fail
        (`cause` is CauseKind.MEMBER_SUSPECTED); members that do not join it within
        a short bound are left out. A no-op when a later round is already open."""

    def mark_in_place(self, round_number: int) -> None:
        """Say that this run's workers re-form in place (once they showed it)."""

    def report_failure(self, number: int, failure: dict) -> None: ...

    def publish_event(self, record: dict) -> None: ...

    def give_notice(self, round_number: int) -> None:
        """Announce that this node is about to be reclaimed."""

    def notices(self, plan: Plan) -> list[str]:
        """Members of `plan` that announced their departure during its round."""

    def finish(self, plan: Plan) -> None: ...

    def change_marker(self) -> int: ...

    def wait_for_change(self, timeout_s: float, since: int) -> bool:
        """Sleep until something changed after `since` (or wake()), or the timeout."""

    def wake(self) -> None: ...

    def interrupt(self) -> None:
        """Stop waiting for rounds: next_plan raises ShutdownRequested."""

    def seconds_since_etcd_answered(self) -> float: ...


class Workers(Protocol):
    """One node's workers of one round (WorkerGroup in production)."""

    @property
    def pids(self) -> list[int]: ...

    def poll(self) -> list[WorkerExit | None]: ...

    def first_failure(self) -> WorkerExit | None: ...

    def stalled(self, progress_dir: Path, timeout_s: float) -> WorkerExit | None: ...

    def stopped_for_resize(self) -> bool: ...

    def all_succeeded(self) -> bool: ...

    def signal_all(self, signum: int) -> None: ...

    def dump_stacks(self, local_ranks: Sequence[int]) -> None:
        """These workers (which ran er.init) write their Python stacks to their logs."""

    def wait(self, timeout_s: float) -> bool:
        """True once every worker exited, False if some still run after `timeout_s`."""

    def stop(self, grace_s: float) -> None: ...

    def reassign(self, plan: Plan, node_id: str) -> None:
        """The same processes now hold this node's ranks of `plan` (re-formed in place)."""


class StartWorkers(Protocol):
    """Starts this node's workers of a plan (WorkerGroup.start in production); with no
    plan, standby workers that wait for their place (agent/standby.py)."""

    def __call__(self, plan: Plan | None, node_id: str, job: WorkerEnv, config: WorkerConfig,
                 base_env: dict[str, str], echo: bool = True,
                 error_dir: Path | None = None, prewarm: Any = None) -> Workers: ...


class NoticeWatcher(Protocol):
    """Learns of this node's spot reclaim from outside (CloudNoticeWatcher)."""

    notice: threading.Event

    @property
    def source(self) -> str: ...

    def start(self) -> object: ...

    def stop(self) -> None: ...
