"""A broken round fails a blocked collective at once (worker/broken_round.py, abort.GroupSockets).

The sockets are real loopback connections; the agent's half runs on the fakes of
test_agent_reform.py; a real gloo group with a frozen member is in
tests/integration/test_cut_group.py and the e2e freeze test.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from elastic_runner.reform import TRAINING, ReformChannel
from elastic_runner.rendezvous.protocol import Cause, CauseKind
from elastic_runner.worker.abort import GroupSockets, capturing_new_groups, group_sockets
from elastic_runner.worker.broken_round import BrokenRoundWatch
from tests.helpers.reform_fakes import Node
from tests.unit.test_agent_reform import LOST_X


@pytest.fixture
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def connect(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    """(our end, the peer's end) of one loopback connection."""
    ours = socket.create_connection(listener.getsockname(), timeout=5)
    theirs, _ = listener.accept()
    theirs.settimeout(5)
    return ours, theirs


def test_cut_shuts_down_the_connections_opened_while_capturing_and_no_other(listener):
    sockets = GroupSockets()
    before, before_peer = connect(listener)
    with sockets.capture():
        inside = socket.create_connection(listener.getsockname(), timeout=5)
        group_listener = socket.create_server(("127.0.0.1", 0))
    inside_peer, _ = listener.accept()  # the peer's end: opened after the capture
    inside_peer.settimeout(5)
    try:
        assert sockets.cut() == 1
        assert inside_peer.recv(1) == b""  # the peer sees the connection end
        with pytest.raises(OSError):
            inside.send(b"x")
        before.sendall(b"ok")  # opened before the capture: untouched
        assert before_peer.recv(2) == b"ok"
        late, _ = connect(group_listener)  # a listening socket is never shut down
        late.close()
    finally:
        for sock in (before, before_peer, inside, inside_peer, group_listener):
            sock.close()


def captured_then_closed(listener: socket.socket) -> tuple[GroupSockets, int]:
    """A GroupSockets that captured one connection, since closed; its descriptor number
    (the lowest free one: the next descriptor opened reuses it)."""
    sockets = GroupSockets()
    with sockets.capture():
        first, first_peer = connect(listener)
    number = first.fileno()
    first.close()
    first_peer.close()
    return sockets, number


def test_a_descriptor_number_reused_by_another_socket_is_not_cut(listener):
    sockets, number = captured_then_closed(listener)
    other = socket.socket()
    try:
        if other.fileno() != number:
            pytest.skip("the kernel did not reuse the descriptor number")
        other.connect(listener.getsockname())
        other_peer, _ = listener.accept()
        assert sockets.cut() == 0
        other.sendall(b"ok")
        assert other_peer.recv(2) == b"ok"
        other_peer.close()
    finally:
        other.close()


def test_a_descriptor_number_reused_by_a_file_is_left_alone(listener, tmp_path):
    sockets, number = captured_then_closed(listener)
    with open(tmp_path / "file", "wb") as reused:
        if reused.fileno() != number:
            pytest.skip("the kernel did not reuse the descriptor number")
        assert sockets.cut() == 0
        reused.write(b"still writable")


def test_forget_leaves_nothing_to_cut(listener):
    sockets = GroupSockets()
    with sockets.capture():
        ours, theirs = connect(listener)
    sockets.forget()
    assert sockets.cut() == 0
    ours.close()
    theirs.close()


def test_gloo_groups_made_in_the_training_function_are_captured_and_no_other(listener,
                                                                              monkeypatch):
    """capturing_new_groups wraps torch's group maker while the function runs: the
    connections a gloo group opens are cut with the round's; an NCCL group's, or a
    group made after the function returned, are not."""
    import torch.distributed.distributed_c10d as c10d

    made = []

    def maker(group_size, group_rank, ranks, backend, store, name, **options):
        made.append(socket.create_connection(listener.getsockname(), timeout=5))
        return f"{name}:{backend}"

    monkeypatch.setattr(c10d, "_new_process_group_helper", maker)
    group_sockets.forget()
    try:
        with capturing_new_groups():
            assert c10d._new_process_group_helper(2, 0, [0, 1], "gloo", None, "a") == "a:gloo"
            c10d._new_process_group_helper(2, 0, [0, 1], "cpu:gloo,cuda:nccl", None, "b")
        assert c10d._new_process_group_helper is maker
        c10d._new_process_group_helper(2, 0, [0, 1], "gloo", None, "c")
        peers = [listener.accept()[0] for _ in made]  # in the order they connected
        for peer in peers:
            peer.settimeout(5)
        made += peers
        assert group_sockets.cut() == 1
        assert peers[0].recv(1) == b""  # shut down under the gloo group
        for ours, theirs in zip(made[1:3], peers[1:]):
            ours.sendall(b"x")
            assert theirs.recv(1) == b"x"
    finally:
        group_sockets.forget()
        for end in made:
            end.close()


def test_members_of_a_group_meet_first_and_no_one_else(monkeypatch):
    """With before_group, each member of a group about to be made meets the others
    (formation.meet_members) with the group's timeout, or its store's; a rank not in
    the group, and the default group (no ranks listed), meet nobody."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    class Store:
        timeout = datetime.timedelta(seconds=7)

    def maker(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
              backend_options=None, timeout=None):
        made.append(group_name)
        return group_name

    made, met, store = [], [], Store()
    monkeypatch.setattr(c10d, "_new_process_group_helper", maker)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    with capturing_new_groups(lambda *meeting: met.append(meeting)):
        c10d._new_process_group_helper(2, 1, [0, 1], "gloo", store, "a",
                                       timeout=datetime.timedelta(seconds=5))
        c10d._new_process_group_helper(2, None, [0, 2], "gloo", store, "b")
        c10d._new_process_group_helper(3, 1, [], "gloo", store, "c")
        c10d._new_process_group_helper(3, 1, [0, 1, 2], "gloo", store, "d")
    assert made == ["a", "b", "c", "d"]
    assert met == [(store, "a", 2, 5.0), (store, "d", 3, 7.0)]


def test_a_group_maker_that_names_its_store_otherwise_makes_groups_without_a_meeting(
        monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def maker(group_size, group_rank, global_ranks_in_group, backend, pg_store, pg_name):
        return pg_name

    met = []
    monkeypatch.setattr(c10d, "_new_process_group_helper", maker)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    with capturing_new_groups(lambda *meeting: met.append(meeting)):
        assert c10d._new_process_group_helper(2, 0, [0, 1], "gloo", object(), "a") == "a"
        with pytest.raises(TypeError):  # torch's own error for a bad call, not ours
            c10d._new_process_group_helper(2, 0, [0, 1], "gloo", object(), "a", "extra")
    assert met == []


def test_a_torch_without_the_group_maker_is_left_as_it_is(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_new_process_group_helper")
    with capturing_new_groups():
        assert not hasattr(c10d, "_new_process_group_helper")
    assert not hasattr(c10d, "_new_process_group_helper")


def test_the_channel_says_broken_only_for_that_round_and_only_when_asked(tmp_path):
    channel = ReformChannel(tmp_path)
    assert not channel.broken(3)
    channel.ask_pause(3)
    assert channel.pause_asked(3) and not channel.broken(3)
    channel.ask_pause(3, broken=True)
    assert channel.pause_asked(3) and channel.broken(3) and not channel.broken(4)


class CountingSockets:
    def __init__(self):
        self.cuts = 0

    def cut(self) -> int:
        self.cuts += 1
        return 2


@pytest.mark.parametrize("asked, expected_cuts", [
    ({"round": 5, "broken": True}, 1),
    ({"round": 5, "broken": False}, 0),  # a graceful pause: the step boundary handles it
    ({"round": 4, "broken": True}, 0),   # an older round's request
])
def test_the_watch_cuts_once_when_its_round_is_broken(tmp_path, asked, expected_cuts):
    channel = ReformChannel(tmp_path)
    channel.ask_pause(asked["round"], broken=asked["broken"])
    sockets, nccl_aborts = CountingSockets(), []
    with BrokenRoundWatch(channel, lambda: 5, sockets, poll_s=0.01,
                          abort_nccl=lambda: nccl_aborts.append(1) or 1):
        deadline = time.monotonic() + (5 if expected_cuts else 0.3)
        while len(nccl_aborts) < expected_cuts and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a second cut would come within a few polls
    assert sockets.cuts == expected_cuts
    assert len(nccl_aborts) == expected_cuts  # NCCL's communicators with gloo's sockets


def test_a_failed_cut_still_aborts_the_nccl_communicators(tmp_path, caplog):
    class FailingSockets(CountingSockets):
        def cut(self) -> int:
            raise OSError(24, "Too many open files")

    channel = ReformChannel(tmp_path)
    channel.ask_pause(3, broken=True)
    nccl_aborts = []
    with caplog.at_level("WARNING", logger="elastic_runner.worker.runtime"):
        with BrokenRoundWatch(channel, lambda: 3, FailingSockets(), poll_s=0.01,
                              abort_nccl=lambda: nccl_aborts.append(1) or 2):
            deadline = time.monotonic() + 5
            while not nccl_aborts and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
    assert nccl_aborts == [1]
    assert "cutting its group failed" in caplog.text
    assert "aborted 2 NCCL group(s)" in caplog.text


def test_leaving_the_watch_stops_its_thread_at_once(tmp_path):
    before = threading.active_count()
    started = time.monotonic()
    with BrokenRoundWatch(ReformChannel(tmp_path), lambda: 0, CountingSockets(), poll_s=30):
        pass
    assert time.monotonic() - started < 5  # not one 30 s poll
    assert threading.active_count() == before


@pytest.mark.parametrize("cause, broken", [
    (Cause.member_lost(["x"]), True),
    (Cause(CauseKind.MEMBER_SUSPECTED, "y local rank 0: collective-error: reset"), True),
    (Cause(CauseKind.LEASE_EXPIRED), True),  # the others re-formed without this node
])
def test_the_agent_marks_a_round_broken_when_a_member_is_gone(tmp_path, monkeypatch, cause,
                                                              broken):
    asked = record_pause_requests(monkeypatch)
    node = Node(tmp_path, LOST_X)
    node.rendezvous.change = cause
    node.rendezvous.change_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    assert asked == [(0, broken)]


def test_a_notice_is_no_broken_round(tmp_path, monkeypatch):
    asked = record_pause_requests(monkeypatch)
    node = Node(tmp_path, LOST_X)
    node.rendezvous.leaving = ["x"]
    node.rendezvous.leaving_when = lambda: node.channel_shows(TRAINING, 0)
    assert node.run() == 0
    assert asked == [(0, False)]


def record_pause_requests(monkeypatch) -> list[tuple[int, bool]]:
    """(round, broken) of every pause the agent asks, as the workers read it."""
    asked = []
    ask = ReformChannel.ask_pause

    def recording(channel, round_number, broken=False):
        ask(channel, round_number, broken=broken)
        record = json.loads((channel.directory / "pause.json").read_text())
        asked.append((record["round"], record["broken"]))
    monkeypatch.setattr(ReformChannel, "ask_pause", recording)
    return asked


def test_the_step_boundarys_group_takes_the_default_groups_timeout(tmp_path):
    """Not torch's 30 minutes for a gloo new_group: an agreement in flight when a peer
    froze would hold destroy_process_group() that long (step_boundary.py)."""
    import datetime

    import torch
    import torch.distributed as dist

    from elastic_runner.worker.step_boundary import StepBoundary

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=7))
    try:
        boundary = StepBoundary(0, 1, "", "")
        work, _, _ = boundary._start(pause=False)
        work.wait()
        backend = boundary._group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
