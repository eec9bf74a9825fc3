"""`elastic-run [flags] SCRIPT [ARGS]`: parsed flags become the frozen AgentConfig, once.

Why here and nowhere else: everything below the CLI takes its knobs from AgentConfig
and never reads argv or the environment, so a test builds the exact configuration
it needs. Every check on a value happens in `build_config`, before anything touches
etcd or disk beyond --log-dir.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Mapping

from elastic_runner.agent.cloud_notice import CLOUDS, DEFAULT_BASE_URLS
from elastic_runner.cli.flags import (
    default_run_id, parse_endpoints, parse_label, parse_nodes, parse_nproc, parse_rank0_prefer,
    read_password,
)
from elastic_runner.cli.gpus import used_gpus
from elastic_runner.config import (
    AgentConfig, CloudNoticeConfig, EtcdConfig, RendezvousConfig, WorkerConfig,
)
from elastic_runner.contract import DEFAULT_SIGNALS_TO_HANDLE, PYTHON_ENTRY
from elastic_runner.errors import ConfigError
from elastic_runner.etcd.endpoints import parse_endpoint
from elastic_runner.validation import (
    check_id, check_log_dir, check_master_addr, check_notice_file, check_nproc, check_numbers,
    check_tls_files, sanitize_id, settle_cap,
)

SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def start(args, environ: dict[str, str]) -> int:
    """Build the configuration from parsed flags, set up logging, run the agent until the
    job ends (cli/main.py parses first: it must know -v before anything can fail)."""
    config = build_config(args, environ, count_gpus() if args.nproc_per_node in
                          ("auto", "gpu") else 0)
    setup_logging(config.verbosity, config.rendezvous.node_id)
    from elastic_runner.agent.launch import launch
    return launch(config, environ)


def build_config(args, environ: Mapping[str, str], gpu_count: int) -> AgentConfig:
    min_nodes, max_nodes = parse_nodes(args)
    nproc = parse_nproc(args.nproc_per_node, gpu_count)
    endpoints = () if args.standalone else parse_endpoints(args.rdzv_endpoints)
    for endpoint in endpoints:
        parse_endpoint(endpoint)
    check_numbers(args)
    check_nproc(nproc)
    check_tls_files(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    run_id = check_id(args.run_id, "--run-id") if args.run_id else default_run_id(args)
    node_id = check_id(args.node_id, "--node-id") if args.node_id else \
        sanitize_id(default_node_id(), "node")
    cloud_notice = cloud_notice_config(args.notice_from, args.notice_url)
    log_dir = check_log_dir(args.log_dir)
    argv, fingerprint = entry_argv(args)
    rendezvous = RendezvousConfig(
        run_id, node_id, min_nodes, max_nodes, args.lease_ttl,
        args.join_timeout, args.settle, master_addr(args, endpoints),
        args.master_port, drain_timeout_s=args.notice_deadline + args.stop_grace, nproc=nproc,
        min_workers=args.min_workers, max_workers=args.max_workers,
        settle_max_s=settle_cap(args.settle, args.settle_max),
        suspect_grace_s=args.suspect_grace,
        labels=tuple(sorted(parse_label(t, "--node-label") for t in args.node_label)),
        rank0_prefer=parse_rank0_prefer(args.rank0_prefer),
        devices=used_gpus(environ, nproc))
    if args.max_workers and args.max_workers < max(args.min_workers, nproc):
        raise ConfigError(f"--max-workers {args.max_workers} is below --min-workers or this "
                          f"node's {nproc} worker(s); raise --max-workers")
    etcd = EtcdConfig.build(
        endpoints, args.etcd_timeout, lease_ttl_s=rendezvous.lease_ttl_s,
        cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key, user=args.etcd_user,
        password=read_password(args, environ), binary=args.etcd_binary)
    if args.prewarm and args.no_python:
        raise ConfigError("--prewarm needs a Python entry point: it starts Python with torch "
                          "imported; drop --no-python or --prewarm")
    workers = WorkerConfig(argv, nproc, fingerprint, args.stop_grace, args.monitor_interval,
                           log_dir, gpu_count, worker_timeout_s=args.worker_timeout,
                           prewarm=args.prewarm)
    verbosity = 0 if args.quiet else 1 + args.verbose
    return AgentConfig(rendezvous, etcd, workers, args.max_restarts, verbosity,
                       args.notice_deadline, check_notice_file(args.notice_file),
                       args.metrics_port, args.metrics_addr,
                       signals_to_handle(environ.get(SIGNALS_ENV, DEFAULT_SIGNALS_TO_HANDLE)),
                       cloud_notice=cloud_notice)


def entry_argv(args) -> tuple[tuple[str, ...], str]:
    """The worker command line and a fingerprint all nodes of a run must share."""
    digest = hashlib.sha256()
    if args.module:
        try:
            found = importlib.util.find_spec(args.entrypoint)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"-m {args.entrypoint}: module not importable here; "
                              "check the name and that its package is installed")
        argv = (*PYTHON_ENTRY, "-m", args.entrypoint, *args.args)
        digest.update(args.entrypoint.encode())
    else:
        script = Path(args.entrypoint)
        if not args.no_python and not script.is_file():
            raise ConfigError(f"script not found: {args.entrypoint} "
                              "(give a path to a .py file, or -m MODULE)")
        if args.no_python and shutil.which(args.entrypoint) is None:
            raise ConfigError(f"--no-python: no executable {args.entrypoint!r} (give the path "
                              "of an executable file or the name of a command on PATH)")
        prefix = () if args.no_python else PYTHON_ENTRY
        argv = (*prefix, args.entrypoint, *args.args)
        if script.is_file():
            digest.update(script.read_bytes())
    for arg in args.args:
        digest.update(b"\0" + arg.encode())
    return argv, digest.hexdigest()[:16]


def default_node_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def master_addr(args, endpoints: tuple[str, ...]) -> str:
    if args.master_addr:
        return check_master_addr(args.master_addr)
    return check_master_addr(local_address(endpoints),
                             "this node's own address (found from its route to etcd)")


def local_address(endpoints: tuple[str, ...]) -> str:
    """The address of the interface that routes to etcd: peers can reach it too."""
    if not endpoints:
        return "127.0.0.1"
    host, port, _ = parse_endpoint(endpoints[0])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), port))  # UDP: sends nothing
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def count_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install must not stop a CPU run
        return 0


def cloud_notice_config(cloud: str | None, url: str | None) -> CloudNoticeConfig | None:
    """--notice-from / --notice-url, checked. Environment values skip argparse's choices,
    so the cloud is checked here too; an empty value means off."""
    cloud = (cloud or "").strip().lower()
    url = (url or "").strip()
    if not cloud:
        if url:
            raise ConfigError(f"--notice-url {url!r} needs --notice-from "
                              f"({', '.join(CLOUDS)}): say which cloud's metadata service it is")
        return None
    if cloud not in CLOUDS:
        raise ConfigError(f"--notice-from {cloud!r}: use one of {', '.join(CLOUDS)}")
    if not url:
        return CloudNoticeConfig(cloud, DEFAULT_BASE_URLS[cloud])
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"--notice-url {url!r}: use http://HOST[:PORT] or https://HOST[:PORT] "
                          f"(optionally with a path), e.g. {DEFAULT_BASE_URLS[cloud]}")
    return CloudNoticeConfig(cloud, url.rstrip("/"))


def signals_to_handle(text: str) -> str:
    """torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE, checked: names of catchable signals."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None),
                                                            signal.Signals):
            raise ConfigError(f"{SIGNALS_ENV}={text!r}: {name!r} is not a signal the agent can "
                              f"catch; use names like {DEFAULT_SIGNALS_TO_HANDLE}")
    return ",".join(names) or DEFAULT_SIGNALS_TO_HANDLE


def setup_logging(verbosity: int, node_id: str) -> None:
    level = logging.ERROR if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[elastic-run {node_id}] %(message)s"))
    root = logging.getLogger("elastic_runner")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
