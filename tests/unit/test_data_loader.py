"""er.ElasticDataLoader: batches loaded ahead by DataLoader worker processes, with the
sampler's position (what checkpoints save and resizes agree on) counting only the
batches the loop received; and the sampler refusing a DataLoader that draws it ahead.

Measured before (a DataLoader over `(indices for _, indices in sampler)`, 640 samples,
batch 32, a checkpoint of the sampler after 5 trained steps, then a resume): the saved
step was 9 with 2 workers and 13 with 4, and 128 / 256 samples were never trained.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import socket
import sys
import types

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import elastic_runner as er

SAMPLES, BATCH = 640, 32


class Indices(Dataset):
    """Sample i is the number i: a batch says which samples it holds."""

    def __init__(self, size: int = SAMPLES):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


@pytest.fixture(autouse=True)
def no_workers_left_over():
    """Each test counts its own loader's worker processes: a persistent loader of an
    earlier test stops its workers only once the collector frees it."""
    gc.collect()
    for child in multiprocessing.active_children():
        child.join(timeout=5)
    assert multiprocessing.active_children() == []
    yield
    gc.collect()


def sampler(**kwargs) -> er.ElasticSampler:
    return er.ElasticSampler(SAMPLES, global_batch_size=BATCH, seed=1, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_in_the_loop_counts_the_batches_trained_and_a_resume_skips_none(workers):
    first = sampler()
    trained = []
    for step, batch in er.ElasticDataLoader(Indices(), first, num_workers=workers):
        trained += batch.tolist()
        if step == 5:
            saved = first.state_dict()
            break
    assert (saved["step"], saved["samples_consumed"]) == (5, 5 * BATCH)
    resumed = sampler()
    resumed.load_state_dict(saved)
    steps = []
    for step, batch in er.ElasticDataLoader(Indices(), resumed, num_workers=workers):
        steps.append(step)
        trained += batch.tolist()
    assert steps == list(range(6, SAMPLES // BATCH + 1))
    assert sorted(trained) == list(range(SAMPLES))


def test_each_step_is_the_samplers_own_step_at_every_rank_with_an_empty_share_as_none():
    """World 3, 70 samples, batch 30: the last global batch (10) splits 4/3/3; at 100
    samples and batch 48 the tail of 4 gives rank 3 of 5 ... nothing (None)."""
    for size, batch, world in ((70, 30, 3), (100, 48, 5)):
        for rank in range(world):
            def make():
                return er.ElasticSampler(size, global_batch_size=batch, seed=4,
                                         rank=rank, world_size=world)
            own = [(step, indices) for step, indices in make()]
            loaded = [(step, None if b is None else b.tolist()) for step, b in
                      er.ElasticDataLoader(Indices(size), make(), num_workers=2)]
            assert loaded == [(step, indices or None) for step, indices in own]
    assert any(not indices for _, indices in er.ElasticSampler(
        100, global_batch_size=48, seed=4, rank=4, world_size=5))


def test_a_position_moved_in_the_loop_drops_what_was_loaded_ahead():
    """A State rolled back or synchronised loads the sampler's state in place: the next
    step is the one after that position, not the fourth batch loaded ahead."""
    reference = [indices for _, indices in sampler()]
    moving = sampler()
    seen = []
    marks = {}
    for step, batch in er.ElasticDataLoader(Indices(), moving, num_workers=2,
                                            prefetch_factor=2):
        seen.append((step, batch.tolist()))
        marks[step] = moving.state_dict()
        if step == 6 and len(seen) == 6:
            moving.load_state_dict(marks[2])  # back to after step 2
    assert [step for step, _ in seen] == [1, 2, 3, 4, 5, 6] + list(range(3, SAMPLES // BATCH + 1))
    assert all(indices == reference[step - 1] for step, indices in seen)


def test_set_epoch_in_the_loop_ends_it_as_the_samplers_loop_does():
    moving = sampler()
    steps = []
    for step, _ in er.ElasticDataLoader(Indices(), moving, num_workers=2):
        steps.append(step)
        if step == 3:
            moving.set_epoch(1)
    assert steps == [1, 2, 3]
    assert [step for step, _ in er.ElasticDataLoader(Indices(), moving)][:2] == [4, 5]


def test_persistent_workers_over_two_epochs_and_a_break_mid_epoch():
    moving = sampler()
    loader = er.ElasticDataLoader(Indices(), moving, num_workers=2, persistent_workers=True)
    per_epoch = []
    for epoch in range(2):
        moving.set_epoch(epoch)
        trained = []
        for step, batch in loader:
            trained += batch.tolist()
            if epoch == 0 and step == 4:
                break  # the workers still hold batches loaded ahead
        for step, batch in loader:  # the rest of the epoch (nothing left in epoch 1)
            trained += batch.tolist()
        per_epoch.append(sorted(trained))
    assert per_epoch == [list(range(SAMPLES))] * 2
    assert moving.step == 2 * SAMPLES // BATCH


def test_leaving_the_loop_stops_the_worker_processes():
    loader = er.ElasticDataLoader(Indices(), sampler(), num_workers=2)
    for step, _ in loader:
        assert len(multiprocessing.active_children()) >= 2
        if step == 2:
            break
    assert multiprocessing.active_children() == []


def test_the_step_boundary_comes_after_the_body_and_a_resize_there_ends_the_loop(monkeypatch):
    """The runtime's boundary (an agreed pause or stop) must see the step the loop
    finished, not one a worker process loaded ahead; a resize raised there leaves the
    loop with the workers stopped and the position at that step."""
    calls, trained = [], []

    class Resize(Exception):
        pass

    def at_step_boundary(step, samples):
        calls.append((step, samples, trained[-1]))
        if step == 3:
            raise Resize()

    fake = types.SimpleNamespace(at_step_boundary=at_step_boundary,
                                 sampler_drives_boundaries=lambda s: calls.append("loop"))
    monkeypatch.setitem(sys.modules, "elastic_runner.worker.runtime", fake)
    moving = sampler()
    with pytest.raises(Resize):
        for step, _ in er.ElasticDataLoader(Indices(), moving, num_workers=2):
            trained.append(step)
    assert calls == ["loop", (1, BATCH, 1), (2, BATCH, 2), (3, BATCH, 3)]
    assert moving.step == 3 and moving.samples_consumed == 3 * BATCH
    assert multiprocessing.active_children() == []


def test_a_dataloader_with_workers_over_the_samplers_loop_is_refused():
    with pytest.raises(er.SamplerDrawnAhead, match="DataLoader with 2 worker processes"):
        for _ in DataLoader(Indices(), batch_sampler=(i for _, i in sampler()), num_workers=2):
            pass
    # Without worker processes the DataLoader asks for each batch when the loop does.
    assert sum(1 for _ in DataLoader(Indices(), batch_sampler=(i for _, i in sampler()))) == 20


class SamplerInsideWorkers(IterableDataset):
    def __iter__(self):
        for _, indices in sampler():
            yield indices


def test_a_sampler_iterated_inside_a_worker_process_is_refused():
    with pytest.raises(er.SamplerDrawnAhead, match="inside a DataLoader worker process"):
        for _ in DataLoader(SamplerInsideWorkers(), batch_size=None, num_workers=1):
            pass


@pytest.mark.parametrize("options, message", [
    ({"batch_size": 8}, "batch_size is the sampler's to decide"),
    ({"shuffle": True, "drop_last": True}, "shuffle, drop_last is the sampler's"),
    ({"in_order": False}, "in_order=False hands batches out of order"),
])
def test_options_that_would_change_which_samples_make_a_step_are_refused(options, message):
    with pytest.raises((TypeError, ValueError), match=message):
        er.ElasticDataLoader(Indices(), sampler(), **options)


def test_an_iterable_dataset_or_another_sampler_is_refused():
    with pytest.raises(TypeError, match="map-style dataset"):
        er.ElasticDataLoader(SamplerInsideWorkers(), sampler())
    with pytest.raises(TypeError, match="needs an er.ElasticSampler"):
        er.ElasticDataLoader(Indices(), torch.utils.data.SequentialSampler(Indices()))


def test_the_length_is_the_steps_left_for_this_world():
    moving = sampler(rank=0, world_size=4)
    loader = er.ElasticDataLoader(Indices(), moving)
    assert len(loader) == SAMPLES // BATCH
    next(iter(loader))
    assert len(loader) == SAMPLES // BATCH - 1


def test_loader_workers_do_not_keep_the_training_process_listening_port():
    """A fixed --master-port: rank 0's store listened when the loader's persistent
    workers were forked; once it closed, the next round's store must open the port
    again while those workers live (before: EADDRINUSE until the loader was gone)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    started = []
    loader = er.ElasticDataLoader(Indices(), sampler(), num_workers=1, persistent_workers=True,
                                  worker_init_fn=started.append)
    batches = iter(loader)
    next(batches)
    assert len(multiprocessing.active_children()) == 1
    listener.close()
    again = socket.create_server(("127.0.0.1", port))  # OSError: address in use, before
    again.close()
    assert started == []  # the script's worker_init_fn ran in the worker, not here
    del batches, loader


@pytest.mark.parametrize("make_loader", [
    lambda: er.ElasticDataLoader(Indices(), sampler(), num_workers=1, persistent_workers=True),
    lambda: DataLoader(Indices(), batch_size=4, num_workers=1, persistent_workers=True),
], ids=["er-loader", "torch-loader"])
def test_loader_workers_do_not_keep_the_process_groups_connections_open(make_loader):
    """A training process SIGKILLed beside its loader's workers: before, their copies
    of its gloo connections kept them open, and the peers saw no reset until torch
    ended those workers (up to 5 s later), so a survivor's collective did not fail.
    Any forked process lets go of them (abort.py's fork hook), not only
    er.ElasticDataLoader's workers."""
    from elastic_runner.worker.abort import group_sockets

    server = socket.create_server(("127.0.0.1", 0))
    saved = dict(group_sockets._captured)
    try:
        with group_sockets.capture():  # as a group's formation captures its connections
            ours = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        loader = make_loader()
        batches = iter(loader)
        next(batches)  # the worker is forked and started
        assert len(multiprocessing.active_children()) == 1
        ours.close()  # what the training process's death does to its descriptor
        peer.settimeout(30)
        assert peer.recv(1) == b""  # the end reaches the peer while the loader's worker lives
        assert len(multiprocessing.active_children()) == 1
        del batches, loader
        peer.close()
    finally:
        group_sockets._captured = saved
        server.close()


def test_the_scripts_worker_init_fn_still_runs_in_each_worker(tmp_path):
    loader = er.ElasticDataLoader(Indices(), sampler(), num_workers=2,
                                  worker_init_fn=functools.partial(_touch, tmp_path))
    next(iter(loader))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["worker-0", "worker-1"]


def _touch(folder, worker_id):
    (folder / f"worker-{worker_id}").touch()


def test_closing_inherited_listeners_closes_only_listening_sockets_and_leaks_nothing():
    """In a forked child, as a loader worker: this test process's own listeners (other
    tests' servers) must stay open here."""
    from elastic_runner.worker.data_loader import close_inherited_listeners

    listener = socket.create_server(("127.0.0.1", 0))
    left, right = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if everything holds
        ok = False
        try:
            before = len(os.listdir("/proc/self/fd"))
            closed = close_inherited_listeners()
            after = len(os.listdir("/proc/self/fd"))
            left.sendall(b"x")  # a connected socket stays
            try:
                os.fstat(listener.fileno())
            except OSError:
                ok = closed >= 1 and after == before - closed
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert right.recv(1) == b"x"
    assert listener.getsockname()[1] > 0  # the parent's copy is untouched
    for each in (listener, left, right):
        each.close()
