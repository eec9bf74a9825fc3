"""Ending a worker that stopped for a resize without the interpreter's teardown.

Why: once a worker has saved the agreed step and left its process group, the job
waits for its process to end (the agent's drain, then the next round). Python's
teardown of a process that imported torch frees every object and module one by
one: 0.25 s for torch alone and 0.5 s once torch._dynamo is in (the first
optimizer imports it), measured here on an idle core; in a chaos soak with 8
workers on 2 cores the agents waited 3.2 s between the notice checkpoint and the
workers' exit. Nothing in that teardown is for the user: Python does not promise
to call `__del__` for objects alive at exit (reference, object.__del__).

What the user can see of an ordinary exit is kept, in the same order: the
`finally` blocks and context managers on the way out (SystemExit unwinds the
script as before), non-daemon threads (Python joins them before the exit
handlers), every `atexit` handler (logging's flush, multiprocessing's children,
weakref.finalize), then every file the script left open is closed, outermost
wrapper first (a text file's last line, a gzip stream's trailer), and the standard
streams are flushed. Only then does the process end, through the C library's exit.
"""

from __future__ import annotations

import _io
import atexit
import gc
import io
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

from elastic_runner.contract import EXIT_FOR_RESIZE

@dataclass
class _ProcessExit:
    """This process's one exit: module state, as the process is."""

    enabled: bool = False  # a worker its agent started (er.init read it)
    code: int | None = None  # the exit is armed: the atexit handler is registered
    running: bool = False  # the handler re-enters itself through _run_exitfuncs


_exit = _ProcessExit()


def enable() -> None:
    """This process is a worker that elastic-run started (its environment says so):
    ending it is its own business. Anywhere else (a test, a notebook, torchrun)
    exit_for_resize raises SystemExit alone and the process ends as it would."""
    _exit.enabled = True


def enabled() -> bool:
    return _exit.enabled


def exit_for_resize(code: int = EXIT_FOR_RESIZE) -> NoReturn:
    """Raise SystemExit(code), and end the process right after the exit handlers.
    A script that catches this SystemExit and goes on still ends with `code`: its
    round is over either way."""
    if not _exit.enabled:
        raise SystemExit(code)
    if _exit.code is None:
        # Registered last, so it runs first (LIFO) and runs the others itself.
        atexit.register(_end_after_exit_handlers)
    _exit.code = code
    raise SystemExit(code)


def _end_after_exit_handlers() -> None:
    if _exit.running:
        return
    _exit.running = True
    # The handlers registered before this one, in the order Python would run them
    # (CPython's atexit_callfuncs: last registered first; this one is skipped above).
    atexit._run_exitfuncs()
    close_open_files()
    for stream in (sys.stdout, sys.stderr):
        _quietly(stream.flush)
    _end_process(_exit.code)


def _end_process(code: int) -> NoReturn:
    """The C library's exit: what comes after Python's teardown in an ordinary exit
    still runs (C atexit handlers, C++ static destructors, where a profiler or
    coverage tool flushes what it gathered): 0.08 s measured here, against 0.02 s
    for os._exit, which skips those too, and 0.5 s with the teardown. The GIL stays
    held (PyDLL), so no other Python thread runs meanwhile, as after a teardown."""
    try:
        import ctypes

        ctypes.PyDLL(None).exit(code)
    except (ImportError, OSError, AttributeError):  # no C library to ask
        pass
    os._exit(code)


def close_open_files() -> int:
    """Close every open file object, as teardown would; return how many. Wrappers
    go before what they wrap, so each close can still write its buffered data into
    the next layer down. The standard streams, and any other file on descriptors
    0-2, are only flushed: what comes after (the C library's exit) may still write."""
    gc.unfreeze()  # er.elastic froze the survivors (gc.freeze); get_objects() skips those
    opened = [obj for obj in gc.get_objects() if _is_open_file(obj)]
    standard = _standard_streams()
    closed = 0
    for layer in (io.TextIOBase, _PythonFile, io.BufferedIOBase, io.RawIOBase):
        for handle in opened:
            if _layer_of(handle) is not layer or _is_closed(handle):
                continue
            if id(handle) in standard or _on_standard_descriptor(handle):
                _quietly(handle.flush)
            else:
                closed += _quietly(handle.close)
    return closed


def _on_standard_descriptor(handle: io.IOBase) -> bool:
    try:
        return handle.fileno() in (0, 1, 2)
    except Exception:  # noqa: BLE001 - no descriptor (gzip over BytesIO, a socket file)
        return False


def _standard_streams() -> set[int]:
    """The standard streams and the buffers and files under them: left open."""
    found = set()
    for stream in (sys.stdout, sys.stderr, sys.stdin, sys.__stdout__, sys.__stderr__,
                   sys.__stdin__):
        layer = stream
        while layer is not None:
            found.add(id(layer))
            layer = getattr(layer, "buffer", None) or getattr(layer, "raw", None)
    return found


class _PythonFile:
    """The layer of file objects written in Python over another file (gzip, bz2,
    lzma, zipfile's writers): closed after text wrappers, before buffers."""


_BUILT_IN_LAYERS = {io.TextIOWrapper: io.TextIOBase, io.BufferedWriter: io.BufferedIOBase,
                    io.BufferedRandom: io.BufferedIOBase, io.BufferedRWPair: io.BufferedIOBase,
                    io.BufferedReader: io.BufferedIOBase, io.FileIO: io.RawIOBase}


def _layer_of(handle: io.IOBase) -> type:
    kind = type(handle)
    for built_in, layer in _BUILT_IN_LAYERS.items():
        if issubclass(kind, built_in):
            return layer
    return io.TextIOBase if issubclass(kind, io.TextIOBase) else _PythonFile


def _is_open_file(obj: object) -> bool:
    try:
        # _io._IOBase is the C base of every file object, io.IOBase's too: a plain
        # subclass test, where io.IOBase would ask an ABC for each of ~300k objects;
        # and type(), not isinstance, which reads __class__ (torch.distributed's
        # deprecated reduce_op warns when it is read).
        return issubclass(type(obj), _io._IOBase) and not obj.closed
    except Exception:  # noqa: BLE001 - a detached wrapper, a half-built object
        return False


def _is_closed(handle: io.IOBase) -> bool:
    try:
        return bool(handle.closed)
    except Exception:  # noqa: BLE001 - closing its wrapper detached it
        return True


def _quietly(action) -> int:
    """Call `action`; 1 if it returned, 0 if it raised (printed, as teardown would)."""
    try:
        action()
        return 1
    except Exception as error:  # noqa: BLE001 - one bad file must not keep the rest open
        try:
            print(f"elastic-run worker: ignored at exit: {error}", file=sys.__stderr__,
                  flush=True)
        except Exception:  # noqa: BLE001 - stderr itself is gone
            pass
        return 0
