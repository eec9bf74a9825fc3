"""Workers that survive a resize in their own process (issue 15): the worker's half.

Real worker processes (tests/helpers/inproc_worker.py: `er.State` + `@er.elastic`, a
DDP model, gloo on loopback), each in its own "node" folder with its own re-formation
channel; the test plays every agent through `ReformChannel`: it asks pauses, writes
assignments and starts newcomers, as agent/reform_driver.py does. A worker holds at
step HOLD (its trace says so) until the test releases it, so each fault lands at a
known step. Assertions are outcomes: steps, world sizes, parameter hashes, samples,
exit codes, PIDs. The nodes, the cluster and the shared checks are in
tests/helpers/inproc_cluster.py.
"""

from __future__ import annotations

import os
import signal

import pytest

from elastic_runner.contract import EXIT_FOR_RESIZE, STACKS_SIGNAL
from elastic_runner.etcd.server import free_port
from elastic_runner.reform import (
    ASKED, COLLECTIVE_ERROR, PAUSED, STANDBY, STANDBY_ROUND, TRAINING, Assignment,
)
from tests.helpers.inproc_cluster import (
    DEADLINE_S, HOLD, LAST_STEP, SCRIPT, Cluster, assert_consistent, assign,
    assign_in_order, pids_by_round,
)


@pytest.fixture
def cluster_of(tmp_path):
    made = []

    def make(count: int) -> Cluster:
        made.append(Cluster(tmp_path, count))
        return made[-1]

    yield make
    for cluster in made:
        cluster.stop()


# ---- the scenarios ----------------------------------------------------------------
def test_asked_pause_shrinks_to_two_workers_that_keep_their_processes(cluster_of, tmp_path):
    cluster = cluster_of(3)
    paused = cluster.start_and_pause(cluster.nodes, "--ckpt", str(tmp_path / "ckpt"),
                                     "--every", "7")
    # The pause read at step HOLD's boundary is agreed at the next one (pipelined).
    assert [(s.step, s.reason) for s in paused] == [(HOLD + 1, ASKED)] * 3
    leaver, first, second = cluster.nodes
    port = free_port()
    leaver.channel.assign(0, Assignment(1, leave=True))
    assign(first, 1, 1, 2, port)  # old rank 1 -> 1
    assign(second, 1, 0, 2, port)  # old rank 2 -> 0: hosts the store, writes checkpoints
    assert cluster.exit_codes(cluster.nodes) == [EXIT_FOR_RESIZE, 0, 0]
    assert [n.state().phase for n in (first, second)] == [TRAINING, TRAINING]
    assert {n.state().round for n in (first, second)} == {1}
    assert_consistent(cluster, {0: 3, 1: 2})
    survivors = {first.proc.pid, second.proc.pid}
    assert pids_by_round(cluster) == {0: survivors | {leaver.proc.pid}, 1: survivors}
    assert max(r["step"] for r in cluster.rows("step") if r["round"] == 0) == HOLD + 1
    syncs = [r for r in cluster.rows("sync") if r["round"] == 1]
    assert len(syncs) == 2 and all(r["received"] == 0 for r in syncs)  # both at HOLD + 1
    # The new rank 0 (a survivor that was rank 2) saved on the cadence after the resize.
    assert (tmp_path / "ckpt" / f"step-{28:08d}" / "MANIFEST.json").exists()


def test_a_killed_peer_pauses_the_survivors_who_finish_at_two(cluster_of):
    cluster = cluster_of(3)
    port = free_port()
    for rank, node in enumerate(cluster.nodes):
        node.start(cluster, rank, 3, port, 0, "--hold-at", str(HOLD))
    cluster.wait_held(cluster.nodes)
    first, second, victim = cluster.nodes
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait()
    cluster.go.touch()
    paused = cluster.wait_phase([first, second], 0, PAUSED, expect_exits=(victim,))
    assert all(s.reason.startswith(COLLECTIVE_ERROR + ": ") for s in paused), paused
    assert [s.step for s in paused] == [HOLD, HOLD]  # HOLD + 1 was in flight
    port = free_port()
    assign_in_order((first, second), 1, 2, port)
    assert cluster.exit_codes([first, second, victim]) == [0, 0, -signal.SIGKILL]
    assert_consistent(cluster, {0: 3, 1: 2})
    round1 = [r["step"] for r in cluster.rows("step") if r["round"] == 1]
    assert min(round1) == HOLD + 1  # at most the step in flight is re-done
    assert pids_by_round(cluster)[1] == {first.proc.pid, second.proc.pid}


def test_a_newcomer_receives_the_state_from_one_survivor(cluster_of):
    cluster = cluster_of(3)
    first, second, newcomer = cluster.nodes
    paused = cluster.start_and_pause([first, second])
    assert [s.step for s in paused] == [HOLD + 1, HOLD + 1]
    port = free_port()
    newcomer.start_booted(cluster, 2, 3, port, 1)
    assign_in_order((first, second), 1, 3, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0, 0]
    assert_consistent(cluster, {0: 2, 1: 3})
    syncs = {r["rank"]: r for r in cluster.rows("sync") if r["round"] == 1}
    assert syncs[2]["received"] > 0  # the newcomer's bytes
    assert syncs[0]["received"] == 0 and syncs[1]["received"] == 0
    assert {tuple(r["receivers"]) for r in syncs.values()} == {(2,)}
    assert {r["source"] for r in syncs.values()} == {0}
    assert {r["step"] for r in syncs.values()} == {HOLD + 1}
    assert len({r["hash"] for r in syncs.values()}) == 1  # identical parameters after it


def test_a_node_with_notice_leaves_without_a_checkpoint_and_the_others_pause(
        cluster_of, tmp_path):
    cluster = cluster_of(3)
    port = free_port()
    for rank, node in enumerate(cluster.nodes):
        node.start(cluster, rank, 3, port, 0, "--hold-at", str(HOLD),
                   "--ckpt", str(tmp_path / "ckpt"), "--every", "1000")
    cluster.wait_held(cluster.nodes)
    first, second, leaver = cluster.nodes
    (leaver.dir / "notice").touch()  # its agent relays a spot notice; nobody asks a pause
    cluster.go.touch()
    paused = cluster.wait_phase([first, second], 0, PAUSED, expect_exits=(leaver,))
    assert [(s.step, s.reason) for s in paused] == [(HOLD + 1, ASKED)] * 2
    assert cluster.exit_codes([leaver]) == [EXIT_FOR_RESIZE]
    assert not list((tmp_path / "ckpt").glob("step-*"))  # the state stays with the others
    port = free_port()
    assign_in_order((first, second), 1, 2, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0, EXIT_FOR_RESIZE]
    assert_consistent(cluster, {0: 3, 1: 2})


def test_a_notice_in_a_rounds_first_step_is_taken_in_place(cluster_of, tmp_path):
    """Seen in a chaos soak: a peer's notice came 0.1 s after a re-formation, in the
    round's first step, before the sampler's first boundary; Checkpointer.due() took
    it the restart path's way (every rank saved and exited), so three nodes restarted.
    The notice is here before the first step: the others still pause in place, and
    nothing is checkpointed."""
    cluster = cluster_of(3)
    port = free_port()
    first, second, leaver = cluster.nodes
    (leaver.dir / "notice").touch()
    for rank, node in enumerate(cluster.nodes):
        node.start(cluster, rank, 3, port, 0, "--ckpt", str(tmp_path / "ckpt"), "--every",
                   "1000")
    paused = cluster.wait_phase([first, second], 0, PAUSED, expect_exits=(leaver,))
    assert {(s.step, s.reason) for s in paused} == {(2, ASKED)}  # the pipelined agreement
    assert cluster.exit_codes([leaver]) == [EXIT_FOR_RESIZE]
    assert not list((tmp_path / "ckpt").glob("step-*"))
    assign_in_order((first, second), 1, 2, free_port())
    assert cluster.exit_codes(cluster.nodes) == [0, 0, EXIT_FOR_RESIZE]
    assert_consistent(cluster, {0: 3, 1: 2})


def test_a_save_refused_because_the_round_closed_does_not_end_the_worker(cluster_of, tmp_path):
    """Seen in the spot replay: rank 0 saved the step in flight just after the next
    round got its plan; the record refused it (the round is over) and the worker died
    of StaleWriterError, so a re-formation became a restart. Under er.elastic the
    state lives on in memory: the worker pauses at the boundary, re-forms, and its
    next save is recorded."""
    cluster = cluster_of(2)
    fence = tmp_path / "next-round-has-a-plan"
    ckpt = tmp_path / "ckpt"
    port = free_port()
    for rank, node in enumerate(cluster.nodes):
        node.start(cluster, rank, 2, port, 0, "--hold-at", str(HOLD), "--ckpt", str(ckpt),
                   "--every", "1", "--fenced-while", str(fence))
    cluster.wait_held(cluster.nodes)
    fence.touch()
    for node in cluster.nodes:
        node.channel.ask_pause(0)
    cluster.go.touch()
    paused = cluster.wait_phase(cluster.nodes, 0, PAUSED)
    assert [(s.step, s.reason) for s in paused] == [(HOLD + 1, ASKED)] * 2
    first, second = cluster.nodes
    assert f"checkpoint step {HOLD + 1} not recorded" in first.output()
    fence.unlink()
    port = free_port()
    assign_in_order((first, second), 1, 2, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0]
    assert_consistent(cluster, {0: 2, 1: 2})
    assert pids_by_round(cluster)[1] == {first.proc.pid, second.proc.pid}
    assert (ckpt / f"step-{LAST_STEP:08d}" / "MANIFEST.json").exists()


def test_a_standby_newcomer_is_ready_before_the_pause_and_joins_with_its_model_built(
        cluster_of, tmp_path):
    """A joining node's worker started on standby (agent/standby.py): it runs the script
    up to train() with no process group, restores the checkpoint as a reader only, and
    says STANDBY; only then do the others pause. Its assignment puts it in the group,
    where it receives the newest state."""
    cluster = cluster_of(4)
    first, second, newcomer, quitter = cluster.nodes
    ckpt = ("--ckpt", str(tmp_path / "ckpt"), "--every", "4")
    port = free_port()
    for rank, node in enumerate((first, second)):
        node.start(cluster, rank, 2, port, 0, "--hold-at", str(HOLD), *ckpt)
    cluster.wait_held([first, second])  # HOLD is a multiple of 4: its checkpoint exists
    for node in (newcomer, quitter):
        node.start_standby(cluster, *ckpt)
    ready = cluster.wait_phase([newcomer, quitter], STANDBY_ROUND, STANDBY)
    assert [s.step for s in ready] == [HOLD, HOLD]  # restored: the checkpoint of step HOLD
    assert not any(row["pid"] == newcomer.proc.pid for row in cluster.rows("sync"))
    quitter.channel.assign(0, Assignment(1, leave=True))  # its node gave up joining
    for node in (first, second):
        node.channel.ask_pause(0)
    cluster.go.touch()
    paused = cluster.wait_phase([first, second], 0, PAUSED, expect_exits=(quitter,))
    assert [s.step for s in paused] == [HOLD + 1, HOLD + 1]
    port = free_port()
    assign_in_order((first, second), 1, 3, port)
    assign(newcomer, 1, 2, 3, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0, 0, EXIT_FOR_RESIZE]
    assert_consistent(cluster, {0: 2, 1: 3})
    syncs = {r["rank"]: r for r in cluster.rows("sync") if r["round"] == 1}
    assert syncs[2]["pid"] == newcomer.proc.pid and syncs[2]["received"] > 0
    assert {r["step"] for r in syncs.values()} == {HOLD + 1}
    assert not any(row["pid"] == quitter.proc.pid for row in cluster.rows("step"))
    # Rank 0 alone wrote checkpoints: the standby readers wrote nothing (no probe).
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()
                  if not path.name.startswith("step-")) == []


def test_a_round_whose_group_never_forms_is_paused_in_and_the_next_one_taken(cluster_of):
    """A member of the new round never comes (reclaimed after the round closed): the
    others give up on that round after the formation timeout, pause in it with a
    collective error (evidence for the agent) and take the next assignment, in place.
    That next round also has a freshly started worker (a node that took the restart
    path): the survivors' failed attempt must not change how they name the new group,
    or they and the fresh worker wait for each other's keys until they time out."""
    cluster = cluster_of(3)
    first, second, fresh = cluster.nodes
    cluster.start_and_pause([first, second])
    port = free_port()
    assign_in_order((first, second), 1, 3, port)  # rank 2 of round 1 never starts
    stuck = cluster.wait_phase([first, second], 1, PAUSED)
    assert all(s.reason.startswith(f"{COLLECTIVE_ERROR}: round 1 did not form") for s in stuck)
    assert [s.step for s in stuck] == [HOLD + 1, HOLD + 1]  # nothing trained meanwhile
    port = free_port()
    fresh.start_booted(cluster, 2, 3, port, 2)
    assign_in_order((first, second), 2, 3, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0, 0]
    assert_consistent(cluster, {0: 2, 2: 3})
    assert pids_by_round(cluster)[2] == {first.proc.pid, second.proc.pid, fresh.proc.pid}


def test_a_round_called_off_while_its_group_forms_is_left_at_once(cluster_of):
    """A member of the new round is lost before its group forms (reclaimed just after
    the round closed): the agents ask a pause for that round, and the ranks that came
    stop forming it at once instead of waiting out the formation timeout (here longer
    than the test's deadline), report PAUSED (asked) in it and take the next round in
    place. Both ways a member can be missing: not rank 0 (the store is up, the count
    never completes) and rank 0 itself (there is no store to reach)."""
    from torch.distributed import TCPStore

    from elastic_runner.worker.formation import arrival_key

    cluster = cluster_of(2)
    cluster.formation_s = int(DEADLINE_S * 2)  # only a call-off can end a formation in time
    first, second = cluster.nodes
    cluster.start_and_pause([first, second])
    port = free_port()
    assign_in_order((first, second), 1, 3, port)  # rank 2 of round 1 never comes
    store = cluster.wait(lambda: _store_client(TCPStore, port), "round 1's store")
    cluster.wait(lambda: store.add(arrival_key(1), 0) == 2, "both ranks forming round 1")
    for node in (first, second):
        node.channel.ask_pause(1)
    called_off = cluster.wait_phase([first, second], 1, PAUSED)
    assert [(s.step, s.reason) for s in called_off] == [(HOLD + 1, ASKED)] * 2
    port = free_port()
    assign(first, 2, 1, 3, port)  # rank 0 of round 2 never comes: no store at all
    assign(second, 2, 2, 3, port)
    for node in (first, second):
        node.channel.ask_pause(2)
    called_off = cluster.wait_phase([first, second], 2, PAUSED)
    assert [(s.step, s.reason) for s in called_off] == [(HOLD + 1, ASKED)] * 2
    port = free_port()
    assign(first, 3, 1, 2, port)
    assign(second, 3, 0, 2, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0]
    assert_consistent(cluster, {0: 2, 3: 2})
    assert pids_by_round(cluster)[3] == {first.proc.pid, second.proc.pid}


def _store_client(tcp_store, port: int):
    """A client of the store rank 0 hosts on `port`, or None while there is none."""
    import datetime

    from torch.distributed import DistError
    try:
        return tcp_store("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=1))
    except DistError:
        return None


def test_a_script_without_a_sampler_pauses_at_its_own_commit(cluster_of):
    """state.commit() is the step boundary of a loop that counts its own steps: an
    asked pause is agreed there, and the workers re-form in place."""
    cluster = cluster_of(2)
    first, second = cluster.nodes
    paused = cluster.start_and_pause(cluster.nodes, "--no-sampler")
    assert [(s.step, s.reason) for s in paused] == [(HOLD + 1, ASKED)] * 2
    port = free_port()
    assign(first, 1, 1, 2, port)  # ranks swap: each trains the other's share from now
    assign(second, 1, 0, 2, port)
    assert cluster.exit_codes(cluster.nodes) == [0, 0]
    assert_consistent(cluster, {0: 2, 1: 2})
    assert pids_by_round(cluster)[1] == {first.proc.pid, second.proc.pid}



def test_a_worker_asked_for_its_stacks_writes_them_to_its_log_and_trains_on(cluster_of):
    """What the agent sends a worker that did not pause in time, before stopping it: the
    stack of every thread goes to the worker's log (er.init registered the handler),
    and the signal alone ends nothing."""
    cluster = cluster_of(1)
    (node,) = cluster.nodes
    node.start(cluster, 0, 1, free_port(), 0, "--hold-at", str(HOLD))
    cluster.wait_held([node])
    os.kill(node.proc.pid, STACKS_SIGNAL)
    log = node.dir / "worker.log"  # whole: a dump of every thread can be long
    cluster.wait(lambda: f'File "{SCRIPT}"' in log.read_text(errors="replace"),
                 "the held frame in the worker's log")
    assert "(most recent call first):" in log.read_text(errors="replace")
    cluster.go.touch()
    assert cluster.exit_codes([node]) == [0]
    assert max(r["step"] for r in cluster.rows("step")) == LAST_STEP
