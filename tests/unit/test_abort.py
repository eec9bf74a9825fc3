"""worker/abort.py: leaving a process group, broken or not, on gloo and (faked) NCCL.

The gloo cases form a real one-process group (world size 1, a FileStore in the test's
folder). The NCCL branch runs twice: on torch's real bookkeeping (a real gloo group
whose backend name is reported as NCCL, so torch's own abort function runs) and on a
fake group that records the order of abort and destroy and can fail either.
"""

from __future__ import annotations

import datetime
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elastic_runner.worker import abort
from elastic_runner.worker.abort import leave_process_group

LOG = logging.getLogger("test_abort")


@pytest.fixture
def gloo_group(tmp_path):
    """A real gloo group of one process; torn down if a test left it behind."""
    counter = iter(range(100))

    def form() -> None:
        store = dist.FileStore(str(tmp_path / f"store-{next(counter)}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))

    form()
    yield form
    if dist.is_initialized():
        dist.destroy_process_group()


def _sum_of_one() -> float:
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return float(tensor)


def test_without_a_group_it_does_nothing():
    assert not dist.is_initialized()
    leave_process_group(LOG)
    assert not dist.is_initialized()


def test_gloo_group_is_gone_and_a_second_leave_is_harmless(gloo_group):
    assert _sum_of_one() == 1.0
    leave_process_group(LOG)
    assert not dist.is_initialized()
    assert dist.group.WORLD is None
    leave_process_group(LOG)
    assert not dist.is_initialized()


def test_the_next_round_can_form_a_group_after_leaving(gloo_group):
    leave_process_group(LOG)
    gloo_group()
    assert _sum_of_one() == 1.0


def test_nccl_branch_on_torch_bookkeeping_aborts_and_leaves_no_group(gloo_group,
                                                                      monkeypatch):
    """torch's _abort_process_group clears what destroy would: no destroy is needed,
    and the process can form its next group."""
    calls = []
    real_abort = dist.distributed_c10d._abort_process_group
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(abort, "_backend_name", lambda _dist, _logger: "nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group",
                        lambda *a: (calls.append("abort"), real_abort(*a))[1])
    monkeypatch.setattr(dist, "destroy_process_group",
                        lambda *a: (calls.append("destroy"), real_destroy(*a))[1])
    leave_process_group(LOG)
    assert calls == ["abort"]
    assert not dist.is_initialized()
    leave_process_group(LOG)
    assert calls == ["abort"]
    gloo_group()
    assert _sum_of_one() == 1.0


class FakeGroup:
    """What leave_process_group sees of torch.distributed, recording each call."""

    def __init__(self, backend: str, abort_clears: bool = True,
                 abort_error: Exception | None = None,
                 destroy_error: Exception | None = None):
        self.backend, self.abort_clears = backend, abort_clears
        self.abort_error, self.destroy_error = abort_error, destroy_error
        self.initialized, self.calls = True, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(dist, "get_backend", lambda *a: self.backend)
        monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", self.abort)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy)

    def abort(self, group=None) -> None:
        self.calls.append("abort")
        if self.abort_error is not None:
            raise self.abort_error
        if self.abort_clears:
            self.initialized = False

    def destroy(self, group=None) -> None:
        self.calls.append("destroy")
        if self.destroy_error is not None:
            raise self.destroy_error
        self.initialized = False


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_aborts_and_nothing_is_left_to_destroy(monkeypatch, backend):
    group = FakeGroup(backend)
    group.install(monkeypatch)
    leave_process_group(LOG)
    assert group.calls == ["abort"]
    assert not group.initialized


def test_nccl_abort_that_leaves_the_group_is_followed_by_destroy(monkeypatch):
    group = FakeGroup("nccl", abort_clears=False)
    group.install(monkeypatch)
    leave_process_group(LOG)
    assert group.calls == ["abort", "destroy"]
    assert not group.initialized


def test_a_failing_nccl_abort_is_logged_and_the_group_destroyed(monkeypatch, caplog):
    group = FakeGroup("nccl", abort_error=dist.DistBackendError("NCCL communicator aborted"))
    group.install(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        leave_process_group(LOG)
    assert group.calls == ["abort", "destroy"]
    assert not group.initialized
    assert "NCCL communicator aborted" in caplog.text


def test_gloo_is_destroyed_without_abort(monkeypatch):
    group = FakeGroup("gloo")
    group.install(monkeypatch)
    leave_process_group(LOG)
    assert group.calls == ["destroy"]


@pytest.mark.parametrize("error", [RuntimeError("Connection closed by peer"),
                                   ValueError("Invalid process group specified")])
def test_a_broken_group_never_raises_on_the_way_out(monkeypatch, caplog, error):
    group = FakeGroup("gloo", destroy_error=error)
    group.install(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        leave_process_group(LOG)
    assert group.calls == ["destroy"]
    assert str(error) in caplog.text


def test_an_unreadable_backend_name_falls_back_to_destroy(monkeypatch):
    group = FakeGroup("nccl")
    group.install(monkeypatch)

    def unreadable(*args):
        raise RuntimeError("Default process group has not been initialized")
    monkeypatch.setattr(dist, "get_backend", unreadable)
    leave_process_group(LOG)
    assert group.calls == ["destroy"]


@pytest.mark.parametrize("given, kept", [(None, "2"), ("1", "2"), ("0", "0"), ("3", "3")])
def test_nccl_errors_leave_the_process_alive_unless_the_user_chose_otherwise(
        monkeypatch, given, kept):
    """The launcher's TearDown (1, or torch's default when unset) becomes CleanUpOnly
    (2): the communicators are aborted and the worker lives on to re-form."""
    from elastic_runner.worker.abort import survive_nccl_errors

    if given is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    else:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given)
    survive_nccl_errors()
    import os
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == kept


def test_a_failed_formation_does_not_rename_the_next_group():
    """A formation that times out has already counted a default group (torch names it
    after that count, and the name prefixes every store key): after leaving, this
    process names its next group as a fresh process does, so they find each other."""
    from elastic_runner.etcd.server import free_port

    with pytest.raises(dist.DistError):  # rank 1 of 2, nobody listening
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=1,
                                world_size=2, timeout=datetime.timedelta(seconds=1))
    assert dist.distributed_c10d._world.group_count == 1  # torch counted it
    leave_process_group(LOG)
    assert dist.distributed_c10d._world.group_count == 0


# ---- abort_nccl_communicators: the broken-round watch's NCCL half ---------------------
class FakeNcclBackend:
    """Stands for ProcessGroupNCCL: records its aborts, can fail one."""

    def __init__(self, error: Exception | None = None):
        self.aborts, self.error = 0, error

    def abort(self) -> None:
        self.aborts += 1
        if self.error is not None:
            raise self.error


class FakeProcessGroup:
    """A group as torch's registry holds it: a CUDA backend, or none (gloo alone)."""

    def __init__(self, cuda_backend=None):
        self.cuda_backend = cuda_backend

    def _get_backend(self, device):
        assert device.type == "cuda"
        if self.cuda_backend is None:
            raise RuntimeError("No backend type associated with device type cuda")
        return self.cuda_backend


def install_nccl_groups(monkeypatch, groups: list) -> dict:
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNcclBackend, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    registry = {group: f"pg{index}" for index, group in enumerate(groups)}
    monkeypatch.setattr(dist.distributed_c10d, "_world", SimpleNamespace(pg_names=registry))
    return registry


def test_every_nccl_backend_is_aborted_and_the_registry_left_alone(monkeypatch, caplog):
    default, subgroup = FakeNcclBackend(), FakeNcclBackend(RuntimeError("comm gone"))
    gloo_only = FakeProcessGroup()  # the step boundary's group: no CUDA backend
    other_kind = FakeProcessGroup(cuda_backend=object())  # a CUDA backend that is not NCCL
    registry = install_nccl_groups(monkeypatch, [FakeProcessGroup(default), gloo_only,
                                                 FakeProcessGroup(subgroup), other_kind])
    before = dict(registry)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        aborted = abort.abort_nccl_communicators(LOG)
    assert aborted == 1  # the failing one is not counted
    assert (default.aborts, subgroup.aborts) == (1, 1)
    assert "comm gone" in caplog.text
    assert registry == before  # the training thread clears it when it leaves the group


def test_without_nccl_nothing_is_aborted_and_a_gloo_group_keeps_working(gloo_group):
    assert abort.abort_nccl_communicators(LOG) == 0  # CPU-only torch: no NCCL at all
    assert _sum_of_one() == 1.0
