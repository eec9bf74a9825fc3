"""`er.ElasticDataLoader`: batches loaded by DataLoader worker processes, with the
sampler's position counting only the batches that reached the training loop.

Why: the ElasticSampler's position is what a checkpoint saves, what a resize agrees on
and what a newcomer receives, and it advances when a batch is handed out. A torch
DataLoader with worker processes asks for prefetch_factor x num_workers batches before
the first one is trained, so a position read in the loop was that many batches ahead
and a resume skipped them (sampler.py refuses that use). Here the loader loads the
batches ahead from a copy of the position (`ElasticSampler._batches_ahead`) and the
sampler moves only when a batch is yielded: a checkpoint taken in the loop body counts
exactly the batches trained, and the step boundary comes after the body, as with the
sampler's own loop.

A batch drawn ahead is stale once the position moved under it (load_state_dict,
set_epoch, a State rolled back or synchronised, a new world after an in-process
re-formation, where train() iterates again): the loader then drops what it loaded
and draws again from the new position. Prefetched work is wasted, never trained.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, default_collate

from elastic_runner.worker.sampler import (
    ElasticSampler, PlannedBatch, _boundaries_from_here, _step_boundary,
)

# DataLoader arguments that say which samples make a batch: the sampler decides them.
_DECIDED_BY_THE_SAMPLER = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class ElasticDataLoader:
    """Iterate ``(step, batch)`` like the sampler's ``(step, indices)``, with the batch
    loaded by a torch DataLoader (worker processes, pinning, prefetching).

    ``options`` are torch DataLoader's (num_workers, collate_fn, pin_memory,
    prefetch_factor, persistent_workers, worker_init_fn, multiprocessing_context, ...),
    less those the sampler decides (batch_size, shuffle, sampler, batch_sampler,
    drop_last). A rank whose share of the last batch is empty (drop_last=False, fewer
    samples left than ranks) gets ``batch`` None.
    """

    def __init__(self, dataset: Any, sampler: ElasticSampler, **options: Any) -> None:
        if not isinstance(sampler, ElasticSampler):
            raise TypeError(f"ElasticDataLoader needs an er.ElasticSampler; got "
                            f"{type(sampler).__name__}")
        if isinstance(dataset, IterableDataset):
            raise TypeError("ElasticDataLoader needs a map-style dataset (dataset[index]): "
                            "the sampler hands out indices; an IterableDataset has none")
        decided = [name for name in _DECIDED_BY_THE_SAMPLER if name in options]
        if decided:
            raise TypeError(f"ElasticDataLoader: {', '.join(decided)} is the sampler's to "
                            f"decide; give the batch size, shuffle and drop_last to "
                            f"er.ElasticSampler(...)")
        if options.get("in_order", True) is not True:
            raise ValueError("ElasticDataLoader: in_order=False hands batches out of order, "
                             "but the sampler's position counts them in order; leave it True")
        self.dataset = dataset
        self.sampler = sampler
        self._ahead = _BatchesAhead(sampler)
        collate = options.pop("collate_fn", None) or default_collate
        start = _WorkerStart(options.pop("worker_init_fn", None))
        self._loader = DataLoader(dataset, batch_sampler=self._ahead, worker_init_fn=start,
                                  collate_fn=_CollateShare(collate), **options)

    def __len__(self) -> int:
        """Steps left in this epoch for the current world."""
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        sampler = self.sampler
        sampler._follow_world()  # a re-formed group: the same position, split anew
        _boundaries_from_here(sampler)
        epoch = sampler.epoch
        while sampler.epoch == epoch:
            batches = iter(self._loader)
            drawn = self._ahead.drawn  # what this pass draws, in the order it is loaded
            try:
                for batch in batches:
                    planned = drawn.popleft()
                    step = sampler._commit(planned)
                    if step is None:
                        break  # the position moved: draw again from where it is now
                    yield step, batch
                    _step_boundary(step, len(planned.indices))
                else:
                    return
            finally:
                # Dropped now, not with this frame: a DataLoader iterator's finaliser
                # stops its worker processes (persistent ones stay with the loader).
                batches = None


class _BatchesAhead:
    """The DataLoader's batch sampler: each pass draws from the sampler's position of
    when the pass began, and records each batch it hands to the loader in `drawn`."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self._sampler = sampler
        self.drawn: deque[PlannedBatch] = deque()

    def __len__(self) -> int:
        return len(self._sampler)

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator itself: the DataLoader iterator calls iter() when it is made,
        # and the loop reads `drawn` right after, before the first batch is drawn.
        self.drawn = deque()
        return self._draw(self.drawn)

    def _draw(self, drawn: deque[PlannedBatch]) -> Iterator[list[int]]:
        for planned in self._sampler._batches_ahead():
            drawn.append(planned)
            yield planned.indices


class _CollateShare:
    """The script's collate function, except for an empty share (None): the default
    collate cannot make a batch of nothing. A class, not a closure, so that a spawned
    worker process can unpickle it."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        return self.collate(samples) if samples else None


class _WorkerStart:
    """The script's worker_init_fn, after closing the listening sockets the worker
    process inherited from the training process.

    Why: a worker process forked while rank 0's store (or gloo) listened holds a copy
    of that socket, so the port stays taken after the training process closed it; with
    a fixed --master-port the next round's store cannot open there (EADDRINUSE) while
    the loader's workers live (persistent_workers=True: as long as the loader). A
    loader's worker never accepts connections on its parent's sockets. (Its copies of
    the group's connections are closed by abort.py's fork hook, in any forked process.)"""

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        close_inherited_listeners()
        if self.init is not None:
            self.init(worker_id)


def close_inherited_listeners() -> int:
    """Close this process's listening sockets; how many (0 where /proc is absent)."""
    try:
        descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    closed = 0
    for fd in descriptors:
        try:
            copy = os.dup(fd)
        except OSError:
            continue  # the listing's own descriptor, closed since
        try:
            probe = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            continue  # not a socket
        try:
            listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            listening = 0
        finally:
            probe.close()
        if listening:
            os.close(fd)
            closed += 1
    return closed
