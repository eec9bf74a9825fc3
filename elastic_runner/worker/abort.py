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
"""

from __future__ import annotations

import logging
import os

__all__ = ["leave_process_group", "survive_nccl_errors"]

_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

# What a group on its way out may raise: RuntimeError (and torch's DistError family)
# from the backend; ValueError / AssertionError from torch's bookkeeping when the
# group was already torn down behind our back.
_LEAVE_ERRORS = (RuntimeError, ValueError, AssertionError)


def leave_process_group(logger: logging.Logger) -> None:
    """Leave this process's default process group (and its subgroups), whatever state
    it is in; a no-op when there is none. NCCL: abort, then destroy what is left."""
    import torch.distributed as dist

    if not dist.is_available():
        return
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
