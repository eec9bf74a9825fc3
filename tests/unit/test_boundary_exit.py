"""The step boundary's last agreement at a clean exit (step_boundary.outlive_the_interpreter).

A core dump of a worker killed by SIGABRT after its last step ("terminate called
without an active exception") showed gloo's worker thread dropping the last reference
to the agreement's tensor while the interpreter finalized. These check the remedy's
mechanism: the tensor of the agreement in flight at close() (or abandoned with its
round) keeps a reference that is never released, so no other thread's release is the
last. The race itself needs a loaded machine (1 in 9-16 runs of test_faults' rank-1
test with two CPU hogs) and is measured there, not asserted here."""

from __future__ import annotations

import gc
import sys
import weakref

import torch

from elastic_runner.worker.step_boundary import StepBoundary, outlive_the_interpreter


class DoneWork:
    def wait(self) -> bool:
        return True


def test_a_kept_tensor_is_never_freed():
    tensor = torch.tensor([1, -1], dtype=torch.int32)
    before = sys.getrefcount(tensor)
    outlive_the_interpreter(tensor)
    assert sys.getrefcount(tensor) == before + 1
    alive = weakref.ref(tensor)
    del tensor
    gc.collect()
    assert alive() is not None


def boundary_with_pending(tmp_path) -> tuple[StepBoundary, weakref.ref]:
    boundary = StepBoundary(0, 2, str(tmp_path / "notice"), "")
    flag = torch.tensor([0, 0], dtype=torch.int32)
    boundary._pending = (DoneWork(), flag, False)
    return boundary, weakref.ref(flag)


def test_close_and_abandon_keep_the_agreement_tensor_they_let_go_of(tmp_path):
    for leave in (StepBoundary.close, StepBoundary.abandon):
        boundary, flag = boundary_with_pending(tmp_path)
        leave(boundary)
        gc.collect()
        assert boundary._pending is None and flag() is not None, leave.__name__
