"""`elastic-run`: dispatch to a verb, or run the agent; turn errors into one line.

The only module that reads argv and the process environment (verbs get a copy).
A first word naming a verb (`notice`, `status`, `report`, `deploy`) selects its
module in cli/, loaded by name, each with main(argv, environ) -> exit code;
anything else is the launcher's flags and a script, run by cli/run.py. The
shared flags live in cli/flags.py, so no verb imports this module.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

from elastic_runner.cli.flags import parse_args
from elastic_runner.errors import ElasticRunError, exit_code_for

# Verbs before the script name; each is the module cli/<verb>.py.
VERBS = ("notice", "status", "report", "deploy")


def command(name: str):
    """The module of a verb (or `run`), imported only when used: `report` and `deploy`
    must not pay for grpc, and the launcher not for rich."""
    return importlib.import_module(f"elastic_runner.cli.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ)
    verbose = False  # the detail of an error, once -v is known to be ours (not the script's)
    try:
        if argv[:1] and argv[0] in VERBS:
            return command(argv[0]).main(argv[1:], environ)
        args = parse_args(argv, environ)
        verbose = args.verbose > 0
        return command("run").start(args, environ)
    except ElasticRunError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        if verbose:
            logging.getLogger("elastic_runner").exception("detail")
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The process's end once main() has returned: flush, then leave at once.

    By then the agent has stopped its workers, revoked its lease and printed its last
    line. What interpreter shutdown would still do is tear down grpc's C core under
    daemon threads (the watch's, the keep-alive stream's), and that teardown can block
    for good (grpc/grpc#20026: a close that deadlocks): CI once saw an agent print
    its final error and not exit for 90 s. A finished node must end however a
    library's finalisers behave, so nothing after this point is left to them. An
    internal error keeps its traceback and exit code 1 (the README's exit codes);
    argparse's own exit (usage, --help) comes before any client exists and is left alone."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 - a bug: say where, then end like any other exit
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say on it
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
