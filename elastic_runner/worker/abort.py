"""Leaving a process group that may be broken, without waiting on a dead peer.

Why: an in-process re-formation (elastic.py) leaves the old group after a peer died
or went silent. On gloo, a collective blocked on that peer gives up by itself (its
timeout) and destroying the group returns. On NCCL, the group's communicators may
still hold kernels waiting for the lost peer: a plain `destroy_process_group()`
shuts them down the polite way (finalize, which waits for outstanding work), and
the worker can hang there instead of reaching the next round. Aborting the
communicators first (ncclCommAbort under the hood) drops that work at once.

Two rules hold: a broken group must never stop the worker from leaving it (every
error on the way out is logged at debug and swallowed: the next round's group is
what matters), and nothing here needs CUDA (the abort path is chosen by the group's
backend name, so this module is importable and testable on a CPU-only torch).

Gloo has no abort that reaches a blocked collective (torch 2.13's
ProcessGroupGloo.abort() returns at once and leaves it waiting), so `GroupSockets`
keeps the connections gloo groups opened, and cutting them fails the collective at
once with gloo's own "Connection closed" error, the one a dead peer gives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
import threading
from typing import Callable, Iterator

__all__ = ["GroupSockets", "abort_nccl_communicators", "capturing_new_groups",
           "capturing_sockets", "group_sockets", "leave_process_group", "survive_nccl_errors"]

_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

# What a group on its way out may raise: RuntimeError (and torch's DistError family)
# from the backend; ValueError / AssertionError from torch's bookkeeping when the
# group was already torn down behind our back.
_LEAVE_ERRORS = (RuntimeError, ValueError, AssertionError)


def leave_process_group(logger: logging.Logger, cut: bool = False) -> None:
    """Leave this process's default process group (and its subgroups), whatever state
    it is in; a no-op when there is none. NCCL: abort, then destroy what is left.

    `cut`: first shut down the connections its gloo groups opened. For a round left
    on a failed collective: destroying a group closes its sockets only once nothing
    else holds it (a DDP's reducer, a frame kept by a traceback), and till then a peer
    still in a collective with this rank waits out the whole collective timeout
    (measured: 12 s, against 0.00 s with the cut)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    if cut:
        try:
            group_sockets.cut()
        except OSError as error:  # then a peer waits its timeout, as without the cut
            logger.debug("cutting the left group's connections: %s", error)
    if dist.is_initialized():
        if "nccl" in _backend_name(dist, logger):
            _abort(dist, logger)
        if dist.is_initialized():  # gloo; or an abort that failed half way
            try:
                dist.destroy_process_group()
            except _LEAVE_ERRORS as error:
                logger.debug("leaving the broken process group: %s", error)
    if not dist.is_initialized():
        _forget_group_names(dist)
        group_sockets.forget()


def _forget_group_names(dist) -> None:
    """The next default group gets the name every fresh process gives its first one.

    distributed_c10d._process_group_name names the default group after
    `_world.group_count`, and that name prefixes every key its ranks exchange in the
    store. destroy_process_group() sets the count back to 0, but an
    init_process_group() that failed (a member never came) has already counted, and a
    destroy that failed half way never reset it: the next group of this process then
    waits for keys a freshly started peer never writes (seen: rounds failing one after
    another with "wait timeout ... keys: /default_pg/3//cpu//0/1")."""
    dist.distributed_c10d._world.group_count = 0


def _backend_name(dist, logger: logging.Logger) -> str:
    """"nccl", "gloo", or a per-device mix such as "cpu:gloo,cuda:nccl"; lower case.
    An unreadable name counts as not NCCL: destroying is then the only way out."""
    try:
        return str(dist.get_backend()).lower()
    except _LEAVE_ERRORS as error:
        logger.debug("cannot read the process group's backend: %s", error)
        return ""


def _abort(dist, logger: logging.Logger) -> None:
    """Abort every communicator of every group, then forget the groups.

    torch.distributed.distributed_c10d._abort_process_group() with no group aborts
    all groups within one ncclGroupStart/End (so that communicators' aborts cannot
    deadlock each other) and then clears the same registries that
    destroy_process_group() clears; after it, dist.is_initialized() is False and a
    new init_process_group() may form the next round's group.
    """
    try:
        dist.distributed_c10d._abort_process_group()
    except _LEAVE_ERRORS as error:
        logger.debug("aborting the process group's communicators: %s", error)


def abort_nccl_communicators(logger: logging.Logger) -> int:
    """Abort the NCCL communicators of every group this process holds, from any thread,
    and leave torch's registries alone; how many NCCL backends were aborted.

    Why: when the agent says a round is broken (a member is lost or frozen), a kernel
    of the training thread may wait for that member until the watchdog's collective
    timeout, and gloo's socket cut does not reach NCCL's own connections.
    ProcessGroupNCCL.abort() is the call torch's watchdog makes from its own thread
    (ncclCommAbort for each communicator): the kernels end, and the next collective
    raises DistBackendError "NCCL communicator was aborted" (NCCLComm::getNcclComm),
    which elastic.py reads as a failed collective. The training thread then leaves
    the group (leave_process_group); aborting an aborted communicator again is a
    no-op there. Zero without NCCL (a CPU-only torch, gloo groups).
    """
    import torch
    import torch.distributed as dist

    nccl_type = getattr(dist, "ProcessGroupNCCL", None)
    if not dist.is_available() or nccl_type is None or not dist.is_nccl_available():
        return 0
    try:  # a snapshot: the training thread may be creating or leaving groups
        groups = list(dist.distributed_c10d._world.pg_names)
    except RuntimeError as error:  # the registry changed size while copied
        logger.debug("cannot list the process groups to abort: %s", error)
        return 0
    aborted = 0
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no CUDA backend in this group (the boundary's gloo group)
            continue
        if not isinstance(backend, nccl_type):
            continue
        try:
            backend.abort()
            aborted += 1
        except _LEAVE_ERRORS as error:
            logger.debug("aborting an NCCL communicator: %s", error)
    return aborted


def survive_nccl_errors() -> None:
    """NCCL errors abort the communicators but leave the process alive, so an
    `er.elastic` worker can re-form in place after a peer is lost.

    The launcher gives workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (TearDown, as
    torchrun does): the watchdog kills the process on a failed or timed-out
    collective. CleanUpOnly (2, ErrorHandlingMode in torch's ProcessGroupNCCL.hpp)
    aborts the communicators and raises in the training thread instead: er.elastic
    re-forms, and a script without it fails with the error, which its agent sees as
    an exit just the same. Read when a ProcessGroupNCCL is built, so set before
    init_process_group. Another value the user chose (0, 3) is kept. The worker
    process's own environment, which the runtime owns."""
    if os.environ.get(_NCCL_ERROR_HANDLING, "1") == "1":
        os.environ[_NCCL_ERROR_HANDLING] = "2"


def _socket_fds() -> dict[int, str]:
    """This process's socket descriptors, each with its "socket:[inode]" identity."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


class GroupSockets:
    """The connections this process's gloo groups opened, to cut when a round breaks.

    Why: a collective whose peer froze (SIGSTOP: socket open, no answer), or whose
    peer left without the exchange it waits for, blocks until the collective
    timeout, though the agent knows within a lease TTL (or at once, on a suspicion)
    that the round is over. Shutting the group's connections down fails it at once;
    the peers' collectives fail with it.

    Which sockets: those that appeared while a group formed (`capture`), told apart
    by inode so that a descriptor number reused later is never touched. Listening
    sockets are skipped: gloo's listener thread aborts the process when its socket
    is shut down under it. Limits: a socket another thread of this process opened
    during a formation is cut too, and a gloo group that connects lazily
    (TORCH_GLOO_LAZY_INIT) opens its connections later, uncaptured.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captured: dict[int, str] = {}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        before = _socket_fds()
        try:
            yield
        finally:
            opened = {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link}
            with self._lock:
                self._captured.update(opened)

    def cut(self) -> int:
        """Shut down every captured connection that is still the one captured; how many."""
        with self._lock:
            captured = dict(self._captured)
        cut = 0
        for fd, link in captured.items():
            try:
                duplicate = os.dup(fd)
            except OSError:
                continue  # closed since
            if not _same_socket(duplicate, link):  # the number now names something else
                os.close(duplicate)
                continue
            with socket.socket(fileno=duplicate) as sock:
                if sock.family not in _IP or sock.getsockopt(socket.SOL_SOCKET,
                                                             socket.SO_ACCEPTCONN):
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
                except OSError:  # not connected (any more)
                    pass
        return cut

    def close_copies(self) -> int:
        """In a process forked from a worker (a DataLoader's worker; run by
        os.register_at_fork below): close its copies of the captured connections and
        listeners; how many.

        Why: a copy kept each connection open after the worker died, so the peers saw
        no reset until the forked process ended too (torch ends a loader's workers up
        to 5 s after their parent), and a survivor's collective waited for the agents
        instead of failing at once. A close here leaves the worker's own descriptor as
        it was (no shutdown). No lock: the fork copied it in whatever state another
        thread held it, and this process runs one thread here."""
        captured, self._captured = dict(self._captured), {}
        closed = 0
        for fd, link in captured.items():
            if _same_socket(fd, link):
                with contextlib.suppress(OSError):
                    os.close(fd)
                    closed += 1
        return closed

    def forget(self) -> None:
        """The groups are gone: their descriptors may be reused by anything."""
        with self._lock:
            self._captured.clear()


_IP = (socket.AF_INET, socket.AF_INET6)


def _same_socket(fd: int, link: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == link
    except OSError:
        return False


# This process's groups, like torch's one default group: a worker has one at a time.
group_sockets = GroupSockets()
# Every process forked from here (a DataLoader's workers, er.ElasticDataLoader's or
# torch's, a script's own multiprocessing) lets go of the group's connections at once.
os.register_at_fork(after_in_child=group_sockets.close_copies)


def capturing_sockets(backend: str) -> contextlib.AbstractContextManager:
    """Around forming a group: keep its connections when it is gloo alone. NCCL's
    own connections are not ours to cut: its communicators are aborted instead."""
    if "nccl" in backend.lower():
        return contextlib.nullcontext()
    return group_sockets.capture()


# torch 2.13: every group torch makes after the default one (new_group, new_subgroups,
# DeviceMesh's) is built by distributed_c10d._new_process_group_helper, which those
# functions look up in the module at each call.
_GROUP_MAKER = "_new_process_group_helper"


# before_group(store, group name, members, timeout in s): called by each member of a
# group about to be made (formation.meet_members).
BeforeGroup = Callable[[object, str, int, float], None]


@contextlib.contextmanager
def capturing_new_groups(before_group: BeforeGroup | None = None) -> Iterator[None]:
    """While the training function runs: the connections of every gloo group it
    makes are kept to cut with the round's own, and with `before_group` each member
    of a group meets the others there first, where a cut round can call it off.

    Why: a side group made in train() (a gloo group for all_gather_object beside
    NCCL training, say) holds a rank blocked on a lost member for that group's
    timeout, which torch sets to 30 minutes for a new gloo group, and the round's
    cut would not reach it: the agent would give up on the in-place re-formation
    and restart every worker. The module's group maker is wrapped while the
    function runs and put back after; a torch without it is left alone (logged).
    Groups with an NCCL part are not captured: their communicators are aborted."""
    import torch.distributed.distributed_c10d as c10d

    make = getattr(c10d, _GROUP_MAKER, None)
    if make is None:
        logging.getLogger(__name__).debug(
            "torch has no %s: groups made in the training function are not cut", _GROUP_MAKER)
        yield
        return

    parameters = inspect.signature(make)

    @functools.wraps(make)
    def make_captured(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        if before_group is not None and global_ranks_in_group:
            try:
                call = parameters.bind(group_size, group_rank, global_ranks_in_group, backend,
                                       *args, **kwargs)
            except TypeError:
                call = None  # torch's own call below raises the same, in its words
            if call is not None:
                _meet_first(before_group, global_ranks_in_group, call)
        with capturing_sockets(str(backend)):
            return make(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)

    setattr(c10d, _GROUP_MAKER, make_captured)
    try:
        yield
    finally:
        setattr(c10d, _GROUP_MAKER, make)


def _meet_first(before_group: BeforeGroup, members, call: inspect.BoundArguments) -> None:
    """`before_group` for a member of the group `call` makes (torch 2.13's helper
    names its arguments store, group_name and timeout; a torch that names them
    otherwise makes its groups without the meeting); non-members make nothing and
    meet nobody."""
    import torch.distributed as dist

    store, name = call.arguments.get("store"), call.arguments.get("group_name")
    if store is None or name is None or dist.get_rank() not in members:
        return
    timeout = call.arguments.get("timeout") or store.timeout
    before_group(store, str(name), len(members), timeout.total_seconds())
