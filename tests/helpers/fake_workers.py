"""What the agent asks a worker group, answered from `poll()`: shared by the agent's
unit tests, whose fake groups differ only in how their workers exit."""

from __future__ import annotations

from pathlib import Path

from elastic_runner.agent.workers import WorkerExit
from elastic_runner.contract import EXIT_FOR_RESIZE
from elastic_runner.errors import exit_code_for


def run_as_the_cli(agent) -> tuple[int, Exception | None]:
    """(exit code, error) of `agent.run()` the way the CLI computes it (errors.py's map)."""
    try:
        return agent.run(), None
    except Exception as exc:
        return exit_code_for(exc), exc


class ExitQueries:
    """Mixin: the `Workers` port's questions about exits; subclasses define poll()."""

    def poll(self) -> list[WorkerExit | None]:
        raise NotImplementedError

    def first_failure(self) -> WorkerExit | None:
        failed = [e for e in self.poll() if e and e.exit_code not in (0, EXIT_FOR_RESIZE)]
        return min(failed, key=lambda e: e.at) if failed else None

    def stalled(self, progress_dir: Path, timeout_s: float) -> WorkerExit | None:
        return None

    def stopped_for_resize(self) -> bool:
        return any(e is not None and e.exit_code == EXIT_FOR_RESIZE for e in self.poll())

    def all_succeeded(self) -> bool:
        return all(e is not None and e.exit_code == 0 for e in self.poll())
