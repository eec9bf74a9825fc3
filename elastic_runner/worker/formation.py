"""Forming a re-formed round's process group in steps that can be called off.

Why: torch's env:// formation blocks inside C++ until every rank of the round is
there or the timeout passed (rank 0's TCPStore waits for its clients, gloo's
full-mesh connect waits for every peer's address). A member reclaimed just after
its round closed never comes, and every other rank then waited out the whole
formation timeout (10 s at --lease-ttl 5) before its agent could re-form without
it, while the agents already knew the round was over. Here the ranks first meet in
the round's store in short, polled steps, and a rank stops meeting as soon as the
round is called off (its agent asked a pause for it, or wrote a later assignment).
Only when every rank is in the store does torch form the group, which then does
not wait for anyone.

The store is the one env:// would make (rank 0 hosts a multi-tenant TCPStore at
MASTER_ADDR:MASTER_PORT, the others connect), under the "default_pg" prefix
`distributed_c10d.init_process_group` puts on a store it made itself, and the round.
"""

from __future__ import annotations

import datetime
import importlib
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from elastic_runner.errors import GroupFormationError
from elastic_runner.reform import ReformChannel

if TYPE_CHECKING:
    from torch.distributed import Store

# One attempt to reach rank 0's store: a rank that waits longer between looks at its
# channel keeps the others paused that much longer after the round is called off.
CONNECT_ATTEMPT_S = 0.5
# The name of the thread an attempt runs in (_Attempt), so that it can be told apart.
CONNECT_THREAD = "elastic-run-store-connect"
# How often a rank counts who has arrived.
ARRIVAL_POLL_S = 0.02
# A group's members come within milliseconds of each other (they reach its making at
# the same step): their meeting looks again after 1, 2, 4 ... ms, up to ARRIVAL_POLL_S.
# Polled every 20 ms from the start, the meeting added 17 ms to a newcomer's state
# transfer (rescale.py, er-inproc join, 2 x 2 workers: 0.053 s without the meeting,
# 0.070 s with it; 0.051-0.056 s with these polls).
GROUP_FIRST_POLL_S = 0.001
# gloo waits this many times a group's timeout for a peer's first connection
# (gloo/transport/tcp/pair.h, Pair::waitUntil: "a longer timeout when waiting for
# initial connect"), and once the timeout for its address in the store.
GLOO_CONNECT_FACTOR = 5
# The shortest timeout a group is formed with: the store waits inside gloo's connect
# only cover the moment between meet() and each peer posting its address.
MIN_INIT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Place:
    """One rank's place in a round's group, as the agent gave it."""

    round: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int


def called_off_by(channel: ReformChannel, local_rank: int, round_number: int
                  ) -> Callable[[], bool]:
    """Whether the agent is done with round `round_number` before its group formed:
    it asked a pause for that round (a member was lost meanwhile), or wrote this
    worker a later assignment."""
    def called_off() -> bool:
        later = channel.assignment(local_rank)
        return channel.pause_asked(round_number) or (
            later is not None and later.round > round_number)
    return called_off


def arrival_key(round_number: int) -> str:
    """The counter in the round's store that every rank adds itself to."""
    return f"elastic-run/round-{round_number}/arrived"


def form_first_group(backend: str, timeout_s: float, round_number: int, rank: int,
                     world_size: int, environ: Mapping[str, str], under_elastic_run: bool) -> None:
    """er.init()'s group. Under elastic-run a fresh worker meets its round's other
    ranks as a re-forming one does, since a round may hold both (a node that took the
    restart path beside nodes that re-formed in place); anywhere else (torchrun, a
    hand-made environment) torch's env:// as ever."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not under_elastic_run or "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        bind_torch_defaults_before_a_group()  # meet() does it on the other path
        dist.init_process_group(backend, timeout=timeout)
        return
    place = Place(round_number, rank, world_size, environ["MASTER_ADDR"],
                  int(environ["MASTER_PORT"]))
    try:
        # Never called off: the restart path stops the fresh workers of a round that is over.
        store = meet(place, timeout_s, called_off=lambda: False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    except dist.DistError as error:
        raise _formation_failed(place, error) from error


def bind_torch_defaults_before_a_group() -> None:
    """Import torch.distributed.nn while no group exists (4 ms; torch._dynamo, which the
    first optimizer imports, would import it later anyway).

    Why: its functions take `group=group.WORLD` as a default argument, evaluated at
    import (torch 2.13, torch/distributed/nn/functional.py). Imported after the first
    group formed, they held that group for the life of the process:
    destroy_process_group() then freed nothing, and the group's gloo threads,
    connections and rank 0's store server lived on, past every re-formation, into the
    interpreter's finalization, where a gloo thread that releases a finished
    collective's tensor must take the GIL and ends the process with std::terminate
    ("terminate called without an active exception", SIGABRT after a clean last
    step). Its collectives also kept using that first group after a re-formation."""
    importlib.import_module("torch.distributed.nn")  # binds group.WORLD while it is None


def _formation_failed(place: Place, error: Exception) -> GroupFormationError:
    """One line for what is no bug of the script: a member of the round was lost while
    the ranks formed (rank 0's host reclaimed, say), or rank 0 could not open the
    store. Its agent re-forms the round; a traceback in every other worker's log only
    hid that (a chaos soak)."""
    if port_taken(error, place.rank):
        return GroupFormationError(
            f"rank 0 of round {place.round} could not open the round's store: port "
            f"{place.master_port} of its host is held by another process (another job "
            f"given the same --master-port, or a process an earlier worker forked while "
            f"its store listened); give each job its own --master-port, or leave it unset "
            f"for a free port per round")
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return GroupFormationError(
        f"rank {place.rank} of round {place.round} could not form its process group "
        f"(rank 0's store at {place.master_addr}:{place.master_port}): {reason}. A member "
        "of the round was lost or its store failed; elastic-run re-forms the round")


def port_taken(error: BaseException, rank: int) -> bool:
    """Rank 0 could not open the round's store: its port is held by another process.

    Why apart from a collective error: it says nothing of the peers, so re-forming in
    place again fails the same way (seen: 900 rounds in 90 s with a fixed
    --master-port, the old store's listening socket kept open by a process the worker
    had forked). The worker fails its re-formation instead, and the agent's restart
    path stops the worker's processes, which frees the port."""
    text = str(error)
    return rank == 0 and ("EADDRINUSE" in text or "address already in use" in text)


def init_timeout_s(backend: str, formation_timeout_s: float) -> float:
    """The timeout a re-formed round's group is created with (init_process_group).

    Why not the formation timeout itself: with gloo, a peer that posted its address
    and then died or froze (reclaimed a moment after every rank met in the store)
    holds each rank waiting for its connection five timeouts, blocked in C++ where
    no call-off reaches it: 30 s at the 6 s formation timeout of --lease-ttl 3, seen
    in a chaos soak, while the agents had long called the round off. Measured here
    (torch 2.13, a peer SIGSTOPped after posting): timeout 2 s -> 10.0 s, 0.4 s ->
    2.0 s. After meet() every rank is in the store, so the 1x store waits are short.
    Other backends (NCCL) get the formation timeout unchanged.
    """
    if "gloo" not in backend:
        return formation_timeout_s
    return max(MIN_INIT_TIMEOUT_S, formation_timeout_s / GLOO_CONNECT_FACTOR)


def meet(place: Place, timeout_s: float, called_off: Callable[[], bool]) -> Store | None:
    """The round's store once every rank of `place`'s round is in it; None when the
    round was called off first. DistStoreError/DistNetworkError when the ranks did
    not all come within `timeout_s` (the caller's evidence that a member is gone).

    Every rank of a round must meet here, fresh workers (er.init) and re-forming
    ones alike: a rank that went straight to torch's env:// would never count."""
    bind_torch_defaults_before_a_group()
    deadline = time.monotonic() + timeout_s
    store = _connect(place, timeout_s, deadline, called_off)
    if store is None:
        return None
    key = arrival_key(place.round)
    if not _count_in(store, key, place.world_size, timeout_s, deadline, called_off):
        return None
    from torch.distributed import PrefixStore

    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    # Per round: with a fixed --master-port a kept rank 0 reopens the round's store on
    # the port of the last one, and TCPStore's multi-tenant server hands it the old
    # server, keys included. The group names start at 0 in every round (abort.py), so
    # under one prefix gloo read the last round's peer addresses and every re-formation
    # in place failed to connect.
    return PrefixStore(f"default_pg/round-{place.round}", store)


def meet_members(store: Store, group_name: str, members: int, timeout_s: float,
                 called_off: Callable[[], bool]) -> None:
    """Before torch makes group `group_name` of `members` ranks: wait in the round's
    store, in polled steps, until every member has come. DistError when the round is
    called off first (its agent cut it: a member is lost), DistStoreError when the
    members did not all come within `timeout_s`; elastic.py reads either as a failed
    collective and re-forms.

    Why: gloo's group creation waits in the store for each member's address, in C++,
    for the group's whole timeout, which no cut reaches (the store's connections are
    not the group's). A member lost at that moment (the boundary's group is made at
    a round's first step, State.sync's as a newcomer is brought in) held the others
    for 12 s though their agents had cut the round at once: the longest stall of two
    chaos soaks (seeds 61 and 113). Once every member has come, gloo's waits cover
    only the moment between this meeting and each member posting its address."""
    from torch.distributed import DistError

    deadline = time.monotonic() + timeout_s
    key = f"elastic-run/group-{group_name}/arrived"
    if not _count_in(store, key, members, timeout_s, deadline, called_off, GROUP_FIRST_POLL_S):
        raise DistError(f"the round was cut while group {group_name} formed (a member is lost)")


def _connect(place: Place, timeout_s: float, deadline: float,
             called_off: Callable[[], bool]) -> Store | None:
    from torch.distributed import DistError, DistNetworkError, TCPStore

    if place.rank == 0:
        return TCPStore(place.master_addr, place.master_port,
                        place.world_size, is_master=True, wait_for_workers=False,
                        multi_tenant=True, timeout=datetime.timedelta(seconds=timeout_s))
    attempt: _Attempt | None = None
    while True:
        if called_off():
            return None  # an attempt still blocked in torch is left to finish on its own
        if time.monotonic() >= deadline:
            raise DistNetworkError(f"rank 0's store at {place.master_addr}:{place.master_port} "
                                   f"did not open and answer within {timeout_s:g} s")
        if attempt is None:
            if not _listening(place.master_addr, place.master_port):
                time.sleep(ARRIVAL_POLL_S)
                continue
            seconds = max(0.05, min(CONNECT_ATTEMPT_S, deadline - time.monotonic()))
            attempt = _Attempt(lambda: TCPStore(
                place.master_addr, place.master_port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=seconds)))
        if not attempt.finished(ARRIVAL_POLL_S):
            continue
        if isinstance(attempt.error, DistError):
            attempt = None  # rank 0's store went away between the probe and the connect
            continue
        if attempt.error is not None:
            raise attempt.error
        attempt.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return attempt.store


class _Attempt:
    """One TCPStore client constructor, run in a daemon thread while the caller keeps
    looking at its channel. Why: torch's constructor can block far past its timeout
    (torch 2.13, c10d TCPStore's constructor): a refused connect backs off up to ~1.4 s
    before the next try whatever the timeout, and its handshake, TCPStore::ping, is a
    recv without a timeout, so it waits forever on a listener that accepts and never
    answers (measured: still there after 10 minutes). The constructor releases the
    GIL. An attempt given up on ends when its peer answers or closes."""

    def __init__(self, make: Callable[[], Store]):
        self.store: Store | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(make,), daemon=True,
                         name=CONNECT_THREAD).start()

    def _run(self, make: Callable[[], Store]) -> None:
        try:
            self.store = make()
        except BaseException as error:  # noqa: BLE001 - handed to the waiting caller
            self.error = error
        finally:
            self._done.set()

    def finished(self, wait_s: float) -> bool:
        return self._done.wait(wait_s)


def _listening(host: str, port: int) -> bool:
    """Whether rank 0's store accepts connections yet. Why ask with a bare socket
    first: a TCPStore client that finds no listener backs off for up to a second
    before it tries again, whatever its timeout (measured: 0.3-1.0 s after the
    server opened), and prints a stack trace for each attempt."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_ATTEMPT_S):
            return True
    except OSError:
        return False


def _count_in(store: Store, key: str, world_size: int, timeout_s: float, deadline: float,
              called_off: Callable[[], bool], first_poll_s: float = ARRIVAL_POLL_S) -> bool:
    """Add this rank to the arrivals and wait for the rest, looking again after
    `first_poll_s`, then twice as long each time up to ARRIVAL_POLL_S: True when all
    came."""
    from torch.distributed import DistError, DistStoreError

    poll_s = first_poll_s
    try:
        arrived = store.add(key, 1)
        while arrived < world_size:
            if called_off():
                return False
            if time.monotonic() >= deadline:
                raise DistStoreError(f"{arrived} of {world_size} ranks came to the round's "
                                     f"store within {timeout_s:g} s")
            time.sleep(poll_s)
            poll_s = min(ARRIVAL_POLL_S, 2 * poll_s)
            arrived = store.add(key, 0)
    except DistError:
        if called_off():  # rank 0 gave up on the round first and took its store along
            return False
        raise
    return True
