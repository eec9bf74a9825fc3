"""Checks on flag values that argparse's types cannot express.

Why a module of its own: every bad value must become one line (what is wrong, what
to do) and exit 2 before anything touches etcd or disk, and the same rules serve
the run verb, `notice`, `status` and the torchrun plug-in. Each check raises
ConfigError; callers that speak another error language (torch's ValueError)
translate it.
"""

from __future__ import annotations

import math
import os
import resource
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic_runner.config import DEFAULT_SETTLE_MAX_S
from elastic_runner.errors import ConfigError
from elastic_runner.ids import id_problem

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
# What one worker costs the agent in file descriptors: stdout and stderr pipes (both
# ends while it starts), its log file, the pumps' duplicates. Measured: ~120 workers
# exhausted a 1024-descriptor limit.
FDS_PER_WORKER = 8
FDS_RESERVED = 64
# A worker is a whole Python interpreter with torch imported; beyond this many per
# core nobody trains, and a typo (10000 for 1000, or for 10) must not fork-bomb a node.
WORKERS_PER_CORE_CAP = 16
WORKERS_FLOOR_CAP = 64


def check_id(value: str, flag: str) -> str:
    """Run and node ids end up in etcd keys, file names and generated scripts."""
    problem = id_problem(value)
    if problem:
        raise ConfigError(f"{flag} {problem}")
    return value


def sanitize_id(text: str, fallback: str = "run") -> str:
    """Turn a derived name (script stem, hostname) into a valid id instead of failing."""
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "-" for c in text)
    cleaned = cleaned.replace("..", "-").lstrip("._-")[:100]
    return cleaned if cleaned and id_problem(cleaned) is None else fallback


def parse_bool(raw: str, name: str) -> bool:
    """A boolean environment variable that is not a boolean is a typo, not `false`."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use one of "
                      f"{', '.join(TRUE_WORDS)} or {', '.join(w for w in FALSE_WORDS if w)}")


@dataclass(frozen=True)
class Bound:
    """The allowed range of one number: `dest` names it in argparse's namespace, `flag`
    is how the CLI's user spells it, `need` says the range in words."""

    dest: str
    flag: str
    ok: Callable[[float], bool]
    need: str


def _positive(v: float) -> bool:
    return v > 0 and math.isfinite(v)


def _non_negative(v: float) -> bool:
    return v >= 0 and math.isfinite(v)


NUMBER_BOUNDS = (
    Bound("lease_ttl", "--lease-ttl", lambda v: v >= 1, "at least 1 second"),
    Bound("join_timeout", "--join-timeout", _positive, "a positive number of seconds"),
    Bound("settle", "--settle", _non_negative, "0 or more seconds"),
    Bound("settle_max", "--settle-max", _non_negative, "0 or more seconds"),
    Bound("suspect_grace", "--suspect-grace", _non_negative, "0 or more seconds"),
    Bound("etcd_timeout", "--etcd-timeout", _positive, "a positive number of seconds"),
    Bound("max_restarts", "--max-restarts", lambda v: v >= 0, "0 or more"),
    Bound("min_workers", "--min-workers", lambda v: v >= 0, "0 (no bound) or more"),
    Bound("max_workers", "--max-workers", lambda v: v >= 0, "0 (no bound) or more"),
    Bound("stop_grace", "--stop-grace", _non_negative, "0 or more seconds"),
    Bound("monitor_interval", "--monitor-interval", _positive, "a positive number of seconds"),
    Bound("notice_deadline", "--notice-deadline", _non_negative, "0 or more seconds"),
    Bound("worker_timeout", "--worker-timeout", _positive, "a positive number of seconds"),
    Bound("master_port", "--master-port", lambda v: 1 <= v <= 65535, "a port in 1-65535"),
    Bound("metrics_port", "--metrics-port", lambda v: 0 <= v <= 65535,
          "a port in 0-65535 (0: any free port)"),
    # Not an argparse number (--nproc-per-node also takes 'auto'): parse_nproc checks it.
    Bound("nproc", "--nproc-per-node", lambda v: v >= 1, "at least 1 worker per node"),
)
BOUNDS = {bound.dest: bound for bound in NUMBER_BOUNDS}


def check_bound(bound: Bound, value, name: str | None = None):
    """`value` if it is in range (None passes: not given), else ConfigError.

    `name` is how the caller's user spelled the setting (the torchrun plug-in's
    `--rdzv-conf lease_ttl`); the rest of the line is the same for every caller.
    """
    if value is not None and not bound.ok(value):
        raise ConfigError(f"{name or bound.flag} {value:g}: need {bound.need}")
    return value


def check_number(dest: str, value, name: str | None = None):
    """One setting against its entry in NUMBER_BOUNDS (see check_bound)."""
    return check_bound(BOUNDS[dest], value, name)


def check_numbers(args) -> None:
    """Negative timeouts, zero intervals and impossible ports fail here, not deep inside."""
    for bound in NUMBER_BOUNDS:
        check_bound(bound, getattr(args, bound.dest, None))
    settle_cap(args.settle, args.settle_max)


def settle_cap(settle: float, settle_max: float | None,
               names: tuple[str, str] = ("--settle", "--settle-max")) -> float:
    """The longest a stream of arrivals may hold a round open.

    Given, it must cover the quiet it caps; absent, DEFAULT_SETTLE_MAX_S, or the
    quiet itself when that is longer (a long --settle alone must not be cut short).
    """
    if settle_max is None:
        return max(DEFAULT_SETTLE_MAX_S, settle)
    if settle_max < settle:
        raise ConfigError(f"{names[1]} {settle_max:g} is below {names[0]} {settle:g}: "
                          "the cap on a round's wait must be at least the quiet it waits for")
    return settle_max


def check_tls_files(cacert: str | None, cert: str | None, key: str | None) -> None:
    """gRPC aborts the whole process (SIGABRT) on a half or mismatched client pair;
    Python's ssl module checks the same files and raises instead."""
    if bool(cert) != bool(key):
        given, missing = ("--etcd-cert", "--etcd-key") if cert else ("--etcd-key", "--etcd-cert")
        raise ConfigError(f"{given} needs {missing} too: a client certificate and its "
                          "private key go together")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if cacert:
            context.load_verify_locations(cacert)
        if cert and key:
            context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS file not found: {exc.filename}") from exc
    except (ssl.SSLError, OSError) as exc:
        what = "--etcd-cacert" if cacert and not (cert and key) else \
            "--etcd-cacert, --etcd-cert and --etcd-key"
        raise ConfigError(f"TLS files rejected ({what}): {exc}. Check that the certificate "
                          "and key are PEM files of one pair and were not swapped") from exc


def check_log_dir(path: str | None) -> Path | None:
    """Create it now: a file in the way is a one-line error, not a worker crash later."""
    if not path:
        return None
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--log-dir {path}: exists and is not a directory; "
                          "pass a directory path") from None
    except OSError as exc:
        raise ConfigError(f"--log-dir {path}: cannot create it ({exc.strerror})") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--log-dir {path}: not writable by this user")
    return folder


def check_master_addr(host: str, flag_name: str = "--master-addr") -> str:
    """The address the other nodes dial for rank 0's store when it is on this node. It
    need not be this machine's own (behind NAT it is not: the store listens on every
    interface), but a name that resolves nowhere, or text that is no host at all, would
    only fail later, in every worker of the round, far from the flag that caused it."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{flag_name} {host!r} does not resolve ({why}); give the address "
                          "or name the other nodes reach this node at") from None
    return host


def check_notice_file(path: str | None) -> Path | None:
    """A notice file already there: the node is being reclaimed before it joined (or
    the file is left from an earlier run, or names some other file). Joining would
    start workers only to stop them at once, re-form every other node twice, and end
    with exit code 0, as a node that trained and left with notice does."""
    if not path:
        return None
    notice = Path(path)
    try:
        written = notice.stat().st_mtime
    except FileNotFoundError:
        return notice
    except OSError as exc:
        raise ConfigError(f"--notice-file {path}: cannot read it ({exc.strerror})") from exc
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(written))
    raise ConfigError(f"--notice-file {path} already exists (written {stamp}): this node has "
                      "a spot notice before joining, so it does not join; remove the file "
                      "if it is left from an earlier run")


def worker_capacity(cpu_count: int | None = None) -> tuple[int, str]:
    """How many workers this node can hold, and which limit says so."""
    soft_files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_procs, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    cores = cpu_count or os.cpu_count() or 1
    limits = [(max(WORKERS_FLOOR_CAP, WORKERS_PER_CORE_CAP * cores),
               f"at most {WORKERS_PER_CORE_CAP} per core, {cores} core(s) here; lower it")]
    if soft_files != resource.RLIM_INFINITY:
        limits.append((max(1, (soft_files - FDS_RESERVED) // FDS_PER_WORKER),
                       f"the open-file limit, ulimit -n {soft_files}, allows no more; "
                       "lower it or raise that limit"))
    if soft_procs != resource.RLIM_INFINITY:
        limits.append((max(1, soft_procs // 2), f"the process limit, ulimit -u {soft_procs}, "
                       "allows no more; lower it or raise that limit"))
    return min(limits)


def check_nproc(nproc: int, capacity: tuple[int, str] | None = None) -> int:
    limit, why = capacity or worker_capacity()
    if nproc > limit:
        raise ConfigError(f"--nproc-per-node {nproc}: this node can hold at most {limit} "
                          f"workers ({why})")
    return nproc
