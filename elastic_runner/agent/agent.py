"""The node agent: rounds in, worker processes out.

One loop: wait for a plan that includes this node, start the workers with the
plan's ranks, watch them and the membership, and on any change stop the workers
at once and go round again. Worker failures are reported to etcd so the job-wide
restart count (decided by whoever closes the next round) names the real culprit.

Workers that report through the re-formation channel (reform.py; scripts written
with `@er.elastic`) are not stopped on a membership change: they pause, are told
their new ranks and go on in their own processes (reform_driver.py). This module
only decides when that applies; whatever goes wrong there falls back to the restart.

A spot notice (SIGTERM with --notice-deadline > 0, --notice-file appearing, or
`elastic-run notice`) is announced in etcd; every agent of the round then drops
a notice file its workers check at each step boundary (see runtime.py), so rank
0 checkpoints the last finished step before the departing node leaves.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from elastic_runner import contract, reform
from elastic_runner.agent import deferred, drain
from elastic_runner.agent.cloud_notice import CloudNoticeWatcher
from elastic_runner.agent.etcd_outage import check_grace, wait_for_etcd
from elastic_runner.agent.ports import NoticeWatcher, Rendezvous, StartWorkers, Workers
from elastic_runner.agent.prewarm import WarmPool
from elastic_runner.agent.reform_driver import InProcessReform, ReformBounds, ReformContext
from elastic_runner.agent.scratch import PasswordFile, create_scratch, remove_orphans
from elastic_runner.agent.signal_relay import SignalRelay
from elastic_runner.agent.standby import WarmStart
from elastic_runner.config import AgentConfig, EtcdConfig
from elastic_runner.contract import EXIT_FOR_RESIZE, read_progress
from elastic_runner.errors import (EtcdFull, EtcdUnavailable, RendezvousError,
                                   ShutdownRequested, WorkerFailure)
from elastic_runner.etcd.client import EtcdClient
from elastic_runner.events import EVENTS_FILE, EventLog
from elastic_runner.rendezvous.failures import describe_exit, failure_message
from elastic_runner.rendezvous.engine import EtcdRendezvous
from elastic_runner.rendezvous.protocol import (
    FINISHED, Cause, CauseKind, JobSpec, Plan, checkpoint_key,
)
from elastic_runner.record_relay import RecordRelay, read_json
from elastic_runner.rendezvous.ranks import plan_problem
from elastic_runner.agent.workers import WorkerExit, WorkerGroup, job_env, standby_env

log = logging.getLogger("elastic_runner")

SUCCEEDED, FAILED, CHANGED, SHUTDOWN, NOTICE = "succeeded", "failed", "changed", "shutdown", \
    "notice"
# REFORM: the plan changed and the workers can re-form in place. GONE: they could not
# (stopped, or left a round without this node): the restart path goes on. FOLLOW, PLACE:
# the plan changed while they have no group yet, or they are ready for one (deferred.py).
REFORM, GONE, FOLLOW, PLACE = "reform", "gone", "follow", "place"


@dataclass(frozen=True)
class Outcome:
    kind: str
    reason: Cause | None = None  # CHANGED, REFORM, GONE: why the plan stopped holding
    failure: WorkerExit | None = None


class Agent:
    """One node's agent. Its collaborators come in as parameters (ports.py) so its
    decisions can be tested without etcd or processes; `on_etcd` builds the real ones."""

    def __init__(self, config: AgentConfig, rendezvous: Rendezvous, etcd: EtcdConfig,
                 base_env: dict[str, str], start_workers: StartWorkers = WorkerGroup.start,
                 cloud_watcher: NoticeWatcher | None = None,
                 read_record: Callable[[], dict | None] | None = None):
        self._config = config
        self._rdzv_config = config.rendezvous
        self.rendezvous = rendezvous
        self._start_workers = start_workers
        # Private to this agent (mode 0700): the worker contract's files.
        self._scratch = create_scratch()
        self._notice_path = self._scratch / contract.NOTICE_FILE
        # Workers' er.report() progress, one small file per rank, read by metrics.
        self.progress_dir = self._scratch / contract.PROGRESS_DIR
        self.progress_dir.mkdir()
        self._error_dir = self._scratch / contract.ERROR_DIR
        self._error_dir.mkdir()
        log_dir = config.workers.log_dir
        self.events = EventLog(config.rendezvous.node_id, config.rendezvous.run_id,
                               log_dir / EVENTS_FILE if log_dir else None,
                               publish=self.rendezvous.publish_event)
        self._password_file = PasswordFile(self._scratch / contract.PASSWORD_FILE, etcd.password)
        self._base_env = dict(base_env)
        # Its workers ask it for the checkpoint record, not etcd (record_relay.py).
        self._record_relay = RecordRelay.start(
            self._scratch, read_record, config.workers.nproc) if read_record else None
        self._job = job_env(config, etcd, self._scratch, self.events.path,
                            self._record_relay.path if self._record_relay else None)
        self._cloud_watcher = cloud_watcher
        self._signal: int | None = None
        self._signal_relay: SignalRelay | None = None
        self._signal_seen = threading.Event()
        channel = reform.ReformChannel(Path(self._job.reform_dir))
        self._reform = InProcessReform(ReformContext(
            channel, rendezvous, self.events, config.rendezvous.node_id,
            ReformBounds.from_config(config), self._signal_seen, config.workers.stop_grace_s,
            config.max_restarts, self.progress_dir, self._notice_path))
        self._deferred = deferred.DeferredWorkers(channel, self._reform.mark_run)
        self._warm_start = WarmStart(rendezvous, channel, self.events, self._start_standby,
                                     config.rendezvous.join_timeout_s,
                                     config.workers.stop_grace_s, self._signal_seen.is_set)
        self._standby: Workers | None = None  # ready before joining (standby.py)
        self._prewarm = WarmPool(  # a waiting interpreter's environment: a standby worker's
            config.workers.argv, lambda local: standby_env(self._base_env, local, self._job,
                                                           config.workers),
            config.workers.nproc) if config.workers.prewarm else None
        self._paused_at = time.monotonic()  # when the workers last stopped training
        self._plan: Plan | None = None  # the round this node's workers are in
        # How long workers keep training while etcd does not answer.
        self._etcd_grace_s = config.rendezvous.etcd_grace_s

    @classmethod
    def on_etcd(cls, config: AgentConfig, client: EtcdClient, etcd: EtcdConfig,
                base_env: dict[str, str]) -> Agent:
        """The production agent: rounds in etcd, real worker processes, and the
        cloud's metadata service when --notice-from asks for it."""
        rdzv = config.rendezvous
        spec = JobSpec(rdzv.min_nodes, rdzv.max_nodes, config.workers.fingerprint,
                       rdzv.min_workers, rdzv.max_workers)
        rendezvous = EtcdRendezvous(client, rdzv, spec, config.max_restarts)
        watcher = (CloudNoticeWatcher(config.cloud_notice, on_notice=rendezvous.wake)
                   if config.cloud_notice is not None else None)
        remove_orphans()  # scratch folders of agents on this machine that were killed
        return cls(config, rendezvous, etcd, base_env, WorkerGroup.start, watcher,
                   read_json(client, checkpoint_key(rdzv.prefix)))

    # ---- signals ----------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """The signals torchrun handles (TORCHELASTIC_SIGNALS_TO_HANDLE): SIGTERM is a
        spot notice (see --notice-deadline); the others stop the node and reach the
        workers as the same signal. Handled in a relay thread (signal_relay.py)."""
        self._signal_relay = SignalRelay(self.request_stop)
        for name in self._job.signals_to_handle.split(","):
            signal.signal(getattr(signal, name.strip()), self._signal_relay.handler)

    def request_stop(self, signum: int) -> None:
        """What a caught signal does (the first one counts): the monitor acts on it at
        its next look, a rendezvous wait ends at once. Public so a test, or a program
        that embeds the agent, can deliver one without a real signal."""
        if self._signal is None:
            self._signal = signum
            self._signal_seen.set()
            self.rendezvous.interrupt()

    # ---- main loop --------------------------------------------------------------
    def run(self) -> int:
        """Run rounds until the workers finish; return this node's exit code."""
        log.info("node %s joining run %s (min %d, max %d nodes, %d worker(s) per node)",
                 self._rdzv_config.node_id, self._rdzv_config.run_id,
                 self._rdzv_config.min_nodes, self._rdzv_config.max_nodes,
                 self._config.workers.nproc)
        try:
            if self._prewarm:  # torch imports while the rendezvous runs
                self._prewarm.fill()
            self._standby = self._warm_start.join()  # registers this node
        except ShutdownRequested:  # before the node was announced: nobody waits for it
            log.info("stopped by %s before joining the run", self._signal_name())
            self.rendezvous.leave()  # the lease its registration kept
            self.close()
            return self._shutdown_code(workers_ok=True)
        except BaseException:  # a duplicate node id, another job's spec: leave no scratch
            self.close()  # (and no standby workers)
            raise
        self.events.emit("joined", addr=self._rdzv_config.node_addr,
                         nproc=self._config.workers.nproc)
        if self._cloud_watcher is not None:
            self._cloud_watcher.start()
        try:
            return self._rounds()
        except (WorkerFailure, RendezvousError) as exc:
            self.events.emit("failed", error=str(exc).splitlines()[0])
            raise
        except ShutdownRequested:
            log.info("stopped by %s during rendezvous", self._signal_name())
            return self._shutdown_code(workers_ok=True)
        finally:
            if self._cloud_watcher is not None:
                self._cloud_watcher.stop()
            self.rendezvous.leave()
            self.close()

    def close(self) -> None:
        """Stop standby workers that never got a place; remove this agent's scratch
        folder (notice marker, progress, password file)."""
        if self._standby is not None:
            self._standby.stop(self._config.workers.stop_grace_s)
            self._standby = None
        if self._prewarm:
            self._prewarm.close()
        for relay in (self._signal_relay, self._record_relay):
            if relay is not None:
                relay.close()
        self._signal_relay = self._record_relay = None
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _start_standby(self) -> Workers:
        self._password_file.write()  # their er.init() reads it, before any round
        return self._start_workers(None, self._rdzv_config.node_id, self._job_env(),
                                   self._config.workers, self._base_env,
                                   echo=self._config.verbosity >= 1, error_dir=self._error_dir,
                                   **self._start_options())

    def _job_env(self) -> contract.WorkerEnv:
        """The job's variables, with the run's origin once this node has registered."""
        if not self._job.run_origin:
            with suppress(EtcdUnavailable):  # then without it this time: the run id names it
                self._job = replace(self._job, run_origin=self.rendezvous.origin())
        return self._job

    def _start_options(self) -> dict:  # the --prewarm pool, if any (fakes take none)
        return {"prewarm": self._prewarm} if self._prewarm else {}

    def _rounds(self) -> int:
        previous: Plan | None = None
        cause = Cause(CauseKind.START)
        while True:
            try:
                plan = self.rendezvous.next_plan(previous, cause)
            except EtcdUnavailable as exc:
                self._wait_for_etcd(exc)
                continue
            self._password_file.write()
            group = self._start(plan, previous, self._paused_at)
            self._plan = plan
            try:
                outcome = self._train(group)
                if outcome.kind in (SUCCEEDED, SHUTDOWN, NOTICE):
                    return self._leave(outcome, group, self._plan)
                cause = self._wind_down(outcome, group, self._plan)
            except EtcdUnavailable as exc:
                group.stop(self._config.workers.stop_grace_s)
                self._wait_for_etcd(exc)
                cause = Cause(CauseKind.ETCD_OUTAGE)
            finally:
                self._password_file.remove()
            previous = self._plan

    def _train(self, group: Workers) -> Outcome:
        """Watch the workers through as many in-process re-formations as they manage
        (`self._plan` follows them); return why they stopped."""
        while True:
            outcome = self._monitor(group, self._plan)
            self._paused_at = time.monotonic()
            if outcome.kind == PLACE:
                if not self._reform.place(group, self._plan, deferred=True):
                    return Outcome(GONE, Cause(CauseKind.OTHER, "workers without a place"))
                continue
            if outcome.kind not in (REFORM, FOLLOW):
                return outcome
            if outcome.kind == FOLLOW:
                moved = self._follow(group, outcome.reason)
            else:
                moved = self._reform.run(group, self._plan, outcome.reason, self._paused_at)
            if moved is None:
                return Outcome(GONE, outcome.reason)
            self._plan = moved

    def _follow(self, group: Workers, cause: Cause) -> Plan | None:
        """The next round, joined while the workers have no group (deferred.py); None,
        the workers stopped, when this node is not in it."""
        try:
            moved = deferred.follow(self.rendezvous, self.events, self._rdzv_config.node_id,
                                    self._plan, cause)
        except BaseException:
            group.stop(self._config.workers.stop_grace_s)
            raise
        if moved is None:
            group.stop(self._config.workers.stop_grace_s)
        return moved

    def _leave(self, outcome: Outcome, group: Workers, plan: Plan) -> int:
        if outcome.kind == SHUTDOWN:
            return self._graceful_exit(group)
        if outcome.kind == NOTICE:
            return self._depart(group, plan)
        self.rendezvous.finish(plan)
        self.events.emit("finished", round=plan.round)
        log.info("workers finished: all %d exited 0", len(group.pids))
        return 0

    def _wind_down(self, outcome: Outcome, group: Workers, plan: Plan) -> Cause:
        """Stop this round's workers; return why, for the next round's record."""
        if outcome.kind == GONE:
            return outcome.reason  # the re-formation already stopped them, or they left
        if outcome.kind == FAILED:
            group.stop(self._config.workers.stop_grace_s)
            return self._record_failure(plan, outcome.failure)
        cause = outcome.reason
        lost = cause.kind is CauseKind.MEMBER_LOST
        self.events.emit("member_lost" if lost else "membership_changed", round=plan.round,
                         reason=cause.text())
        log.info("membership changed: %s; stopping workers and re-forming", cause)
        if cause.kind is CauseKind.NEWCOMER:
            self._drain(group, "a node joins")
        group.stop(self._config.workers.stop_grace_s)
        return cause

    def _wait_for_etcd(self, error: EtcdUnavailable) -> None:
        wait_for_etcd(self.rendezvous, self.events, self._signal_seen,
                      self._rdzv_config.join_timeout_s, error)

    def _start(self, plan: Plan, previous: Plan | None, paused_at: float) -> Workers:
        log.info("%s", plan.describe())
        problem = plan_problem(plan)
        if problem:
            raise RendezvousError(f"refusing to start workers on round {plan.round}: {problem}")
        self.events.emit("round_closed", **plan.event_fields())
        standby, self._standby = self._standby, None
        if standby is not None and self._reform.place(standby, plan):
            self.events.emit("workers_started", round=plan.round, pids=standby.pids,
                             standby=True)
            return standby
        for stale in self.progress_dir.glob("rank*.json"):
            stale.unlink(missing_ok=True)  # last round's progress must not look hung
        self._notice_path.unlink(missing_ok=True)
        self._reform.reset()  # fresh processes: a clean channel, capable once they report
        group = self._start_workers(plan, self._rdzv_config.node_id, self._job_env(),
                                    self._config.workers, self._base_env,
                                    echo=self._config.verbosity >= 1, error_dir=self._error_dir,
                                    **self._start_options())
        self.events.emit("workers_started", round=plan.round, pids=group.pids)
        if previous is not None:
            pause = time.monotonic() - paused_at
            log.info("resized: world size %d -> %d in %.2f s (round %d, restarts %d/%d)",
                     previous.world_size, plan.world_size, pause,
                     plan.round, plan.restart_count, self._config.max_restarts)
            self.events.emit("resize", round=plan.round, old_world_size=previous.world_size,
                             new_world_size=plan.world_size, pause_s=round(pause, 3),
                             cause=plan.cause)
        return group

    def _monitor(self, group: Workers, plan: Plan) -> Outcome:
        while True:
            marker = self.rendezvous.change_marker()
            check_grace(self.rendezvous, self._etcd_grace_s)
            if self._notice_received(plan):
                return Outcome(NOTICE)
            if self._signal_seen.is_set():
                return Outcome(SHUTDOWN)
            if group.all_succeeded():
                return Outcome(SUCCEEDED)
            failure = group.first_failure() or self._hung_worker(group)
            if failure is not None:
                return Outcome(FAILED, failure=failure)
            if group.stopped_for_resize():
                return Outcome(CHANGED, Cause(CauseKind.NOTICE))
            reason = self.rendezvous.change_reason(plan)
            leaving = self.rendezvous.notices(plan)  # read before capable: see _relay_notices
            capable = self._reform.capable(plan, len(group.pids))
            if capable and self._prewarm:  # workers kept through resizes need no successor
                self._prewarm.close()
                self._prewarm = None
            waiting = None if capable else self._deferred.waiting(len(group.pids), plan)
            if reason is not None:
                return Outcome(REFORM if capable else FOLLOW if waiting else CHANGED, reason)
            if waiting == deferred.READY:
                return Outcome(PLACE)
            if capable:  # their own pause, or a peer's notice, starts a re-formation
                reason = self._reform.trigger(plan, leaving)
                if reason is not None:
                    return Outcome(REFORM, reason)
            self._relay_notices(leaving)
            self.rendezvous.wait_for_change(self._config.workers.monitor_interval_s, marker)

    def _hung_worker(self, group: Workers) -> WorkerExit | None:
        timeout = self._config.workers.worker_timeout_s
        return group.stalled(self.progress_dir, timeout) if timeout else None

    def _record_failure(self, plan: Plan, failure: WorkerExit) -> Cause:
        record = failure.as_failure(self._rdzv_config.node_id)
        self.events.emit("worker_exited", round=plan.round, rank=failure.rank,
                         exit_code=failure.exit_code, signal=failure.signal_name)
        log.warning("worker rank %d %s; restarting the round", failure.rank, describe_exit(record))
        seen = self.rendezvous.current_round()
        if seen is not None and seen.state.state == FINISHED:
            # The others already finished: nothing to restart, this node just failed.
            raise WorkerFailure(failure_message(record, self._config.max_restarts))
        self.rendezvous.report_failure(plan.round, record)
        return Cause(CauseKind.WORKER_FAILURE,
                     f"rank {failure.rank} on {self._rdzv_config.node_id}")

    # ---- spot notice ------------------------------------------------------------
    def _notice_received(self, plan: Plan) -> bool:
        """True once this node is told it will be reclaimed (and it has said so)."""
        by_signal = self._signal == signal.SIGTERM and self._config.notice_deadline_s > 0
        by_file = self._config.notice_file is not None and self._config.notice_file.exists()
        by_cloud = self._cloud_watcher is not None and self._cloud_watcher.notice.is_set()
        by_etcd = self._rdzv_config.node_id in self.rendezvous.notices(plan)
        if by_signal or by_file or by_cloud or by_etcd:
            try:
                self.rendezvous.give_notice(plan.round)
            except EtcdFull as exc:  # leaving needs no space: a lease revoke deletes
                log.warning("%s; leaving without announcing the notice", exc)
            source = ("SIGTERM" if by_signal else "file" if by_file
                      else self._cloud_watcher.source if by_cloud else "elastic-run notice")
            self.events.emit("notice", round=plan.round, source=source)
            return True
        return False

    def _relay_notices(self, leaving: list[str]) -> None:
        """Workers that cannot re-form in place stop at their next step boundary.

        `leaving` is read before the workers' capability, so a notice is relayed only
        to workers that had not all reported TRAINING when it was seen."""
        if leaving and not self._notice_path.exists():
            log.info("spot notice from %s: asking workers to checkpoint at the next step",
                     ", ".join(leaving))
            self._notice_path.touch()

    def _drain(self, group: Workers, why: str) -> str:
        """Ask workers to checkpoint the step they are on and exit; return how it ended.

        Used when nothing is lost by waiting a step: a newcomer (scale-up) or a
        member that announced its departure. A crash gets no such courtesy. The
        wait follows the workers' own progress (drain.py), never a blind deadline.
        """
        deadline = self._config.notice_deadline_s
        started = time.monotonic()
        state = drain.view(read_progress(self.progress_dir))
        ended = drain.decide(state, 0.0, deadline)
        if ended is None:
            self._notice_path.touch()
            log.info("%s: workers stop at their next step boundary (agreement within %.1f s: "
                     "%s; then up to --notice-deadline %.0f s for the checkpoint)", why,
                     drain.agreement_wait(state, deadline), _interval_text(state), deadline)
        while ended is None:
            if group.wait(0.05):
                ended = drain.BY_PROGRESS
            else:
                state = drain.view(read_progress(self.progress_dir))
                ended = drain.decide(state, time.monotonic() - started, deadline)
        waited = time.monotonic() - started
        message = {drain.BY_PROGRESS: "workers stopped at a step boundary",
                   drain.NO_BOUNDARY: "workers have no step boundary (no er.ElasticSampler or "
                                      "Checkpointer.due()); stopping them now",
                   drain.BY_DEADLINE: "workers did not reach a step boundary in time; "
                                      "stopping them"}[ended]
        log.info("drain ended after %.2f s: %s", waited, message)
        self.events.emit("drain", reason=why, ended=ended, waited_s=round(waited, 3))
        return ended

    def _depart(self, group: Workers, plan: Plan) -> int:
        """Let rank 0 checkpoint the last step, then leave so the rest re-form.

        Workers without a step boundary cannot act on a notice: they are stopped at
        once. Workers that re-form in place hold no state the others lack: the node
        leaves at once and they follow (InProcessReform.depart). Either way the node
        left as it was asked to: exit 0, unless a worker failed on its own.
        """
        if self._reform.capable(plan, len(group.pids)):
            self._reform.depart(group, plan, self._config.notice_deadline_s)
        else:
            at_once = self._drain(group, "spot notice") == drain.NO_BOUNDARY
            if at_once:
                self.rendezvous.leave()  # peers re-form now, not after our workers are gone
            group.stop(self._config.workers.stop_grace_s)
            if not at_once:
                self.rendezvous.leave()
        stopped = (0, EXIT_FOR_RESIZE, -signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)
        ok = all(e is not None and e.exit_code in stopped for e in group.poll())
        return 0 if ok else 128 + signal.SIGTERM

    # ---- leaving ----------------------------------------------------------------
    def _graceful_exit(self, group: Workers) -> int:
        """Forward the signal, let peers re-form at once, wait for our workers."""
        log.info("%s received: forwarding to workers and leaving the run", self._signal_name())
        self.rendezvous.leave()
        group.signal_all(self._signal or signal.SIGTERM)
        if not group.wait(self._config.workers.stop_grace_s):
            group.stop(0)
        return self._shutdown_code(workers_ok=group.all_succeeded())

    def _shutdown_code(self, workers_ok: bool) -> int:
        if self._signal == signal.SIGTERM and workers_ok:
            return 0
        return 128 + (self._signal or signal.SIGTERM)

    def _signal_name(self) -> str:
        return signal.Signals(self._signal).name if self._signal else "signal"


def _interval_text(state: drain.DrainView) -> str:
    if state.step_interval_s is None:
        return "no step time measured yet"
    return f"{drain.INTERVALS:g} x their median step of {state.step_interval_s:.3f} s"
