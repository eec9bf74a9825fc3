"""Command-line parsing: torchrun-compatible flags plus elastic ones.

The only module that reads argv and the environment. Every flag --foo-bar can
also come from ELASTIC_RUN_FOO_BAR; the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import urllib.parse
from pathlib import Path

from elastic_runner.agent.cloud_notice import CLOUDS, DEFAULT_BASE_URLS
from elastic_runner.config import (
    AgentConfig, CloudNoticeConfig, EtcdConfig, RendezvousConfig, WorkerConfig,
)
from elastic_runner.contract import DEFAULT_SIGNALS_TO_HANDLE
from elastic_runner.errors import ConfigError, ElasticRunError, EXIT_CODES, exit_code_for
from elastic_runner.etcd.endpoints import parse_endpoint
from elastic_runner.validation import (
    check_id, check_log_dir, check_nproc, check_numbers, check_tls_files, parse_bool, sanitize_id,
)

ENV_PREFIX = "ELASTIC_RUN_"
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
DEFAULT_SETTLE_MAX_S = 30.0
# Verbs before the script name; each module has main(argv, environ) -> exit code.
SUBCOMMANDS = {"notice": "notice", "status": "status", "report": "report", "deploy": "deploy"}
log = logging.getLogger("elastic_runner")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-run",
        # torchrun users mistype flags; a prefix such as --max-node must not pass as a flag.
        allow_abbrev=False,
        description="Run a PyTorch training script on every node of an elastic job. "
                    "Start the same command on each node; ranks come from an etcd v3 rendezvous. "
                    "Also: `elastic-run notice --rdzv-endpoints URLS --run-id ID --node-id NODE` "
                    "gives a running node a spot notice.",
        epilog="Exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items())
               + f". Every --flag can also be set as {ENV_PREFIX}FLAG (e.g. {ENV_PREFIX}MIN_NODES).",
    )
    nodes = parser.add_argument_group("membership")
    nodes.add_argument("--min-nodes", type=int, help="fewest nodes to train with (default 1)")
    nodes.add_argument("--max-nodes", type=int, help="most nodes; extras wait as standbys "
                       "(default: --min-nodes)")
    nodes.add_argument("--nnodes", help="torchrun style: N or MIN:MAX")
    nodes.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                       help="workers per node: an integer, or 'auto' (one per GPU, else 1)")
    nodes.add_argument("--node-id", help="this node's name in the run (default hostname-pid)")
    nodes.add_argument("--min-workers", type=int, default=0,
                       help="fewest workers (GPUs) in total to train with (default: no bound)")
    nodes.add_argument("--max-workers", type=int, default=0,
                       help="most workers in total; nodes that would exceed it wait as standbys")
    nodes.add_argument("--node-label", action="append", default=[], metavar="KEY=VALUE",
                       help="label this node (repeatable), e.g. zone=us-east-1c rack=r12 "
                            "lifecycle=spot; nodes sharing a zone, then rack, get contiguous ranks")
    nodes.add_argument("--rank0-prefer", default="lifecycle=on-demand", metavar="KEY=VALUE",
                       help="put rank 0 on a member with this label when there is one "
                            "(default lifecycle=on-demand; 'none' to disable)")
    rdzv = parser.add_argument_group("rendezvous")
    rdzv.add_argument("--rdzv-endpoints", "--rdzv-endpoint", "--rdzv_endpoint",
                      help="comma-separated etcd v3 URLs; absent: start an embedded local etcd")
    rdzv.add_argument("--run-id", "--rdzv-id", help="job name shared by its nodes "
                      "(default: derived from the script name and arguments)")
    rdzv.add_argument("--lease-ttl", type=int, default=5,
                      help="seconds before a crashed node is dropped (default 5)")
    rdzv.add_argument("--join-timeout", type=float, default=600.0,
                      help="seconds to wait for --min-nodes before giving up (default 600)")
    rdzv.add_argument("--settle", type=float, default=2.0,
                      help="a round with enough nodes closes after this many seconds "
                           "with no new node (default 2)")
    rdzv.add_argument("--settle-max", type=float,
                      help="longest a stream of arrivals may hold a round open "
                           f"(default {DEFAULT_SETTLE_MAX_S:g}, or --settle if larger)")
    rdzv.add_argument("--master-addr", help="address peers use to reach this node's "
                      "process-group store (default: the interface that reaches etcd)")
    rdzv.add_argument("--master-port", type=int,
                      help="fixed store port (default: a free port chosen each round)")
    rdzv.add_argument("--standalone", action="store_true",
                      help="single node: embedded etcd, --nnodes 1")
    etcd = parser.add_argument_group("etcd")
    etcd.add_argument("--etcd-binary", help="etcd server for the embedded etcd")
    etcd.add_argument("--etcd-timeout", type=float, default=5.0,
                      help="seconds per etcd call (default 5)")
    etcd.add_argument("--etcd-cacert", help="CA certificate for https endpoints")
    etcd.add_argument("--etcd-cert", help="client certificate")
    etcd.add_argument("--etcd-key", help="client key")
    etcd.add_argument("--etcd-user", help="etcd user name")
    etcd.add_argument("--etcd-password-file", help="file holding the etcd password "
                      f"(or set {ENV_PREFIX}ETCD_PASSWORD; never a flag value)")
    run = parser.add_argument_group("workers")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="job-wide worker failures tolerated; membership changes don't count")
    run.add_argument("--worker-timeout", type=float,
                     help="restart the round when a worker's er.report() progress is older "
                          "than this many seconds (a hung collective); default off")
    run.add_argument("--stop-grace", type=float, default=5.0,
                     help="seconds between SIGTERM and SIGKILL when stopping workers")
    run.add_argument("--monitor-interval", type=float, default=0.1,
                     help="seconds between checks of worker processes")
    run.add_argument("--notice-deadline", type=float, default=25.0,
                     help="seconds a spot notice (SIGTERM) gives rank 0 to checkpoint the current "
                          "step before this node's workers stop; 0 stops them at once")
    run.add_argument("--notice-file", help="treat this file appearing as a spot notice "
                     "(for cloud metadata watchers)")
    run.add_argument("--notice-from", type=str.lower, choices=CLOUDS,
                     help="poll this cloud's instance metadata service every 1-2 s and treat "
                          "its spot notice as one (aws: spot/instance-action over IMDSv2; "
                          "gcp: instance/preempted; azure: a Preempt scheduled event for "
                          "this VM); an unreachable service is one warning, not a failure")
    run.add_argument("--notice-url", metavar="URL",
                     help="base URL of the metadata service for --notice-from (default: the "
                          "cloud's own, http://169.254.169.254 or, for gcp, "
                          "http://metadata.google.internal); for tests or a metadata relay")
    run.add_argument("--log-dir", help="keep each worker's output in DIR/RUN_ID/roundN/rankR.log")
    run.add_argument("-m", "--module", dest="module", action="store_true",
                     help="run the entry point as a module (python -m)")
    run.add_argument("--no-python", action="store_true", help="run the entry point as an executable")
    out = parser.add_argument_group("output")
    out.add_argument("--metrics-port", type=int,
                     help="serve Prometheus metrics on this port (0: any free port)")
    out.add_argument("--metrics-addr", default="0.0.0.0",
                     help="address the metrics endpoint listens on (default 0.0.0.0, all "
                          "interfaces, as Prometheus exporters do; 127.0.0.1 keeps it local)")
    out.add_argument("-v", "--verbose", action="count", default=0, help="more detail")
    out.add_argument("-q", "--quiet", action="store_true", help="errors only")
    parser.add_argument("entrypoint", help="training script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    for action in parser._actions:
        long_flags = [s for s in action.option_strings if s.startswith("--")]
        if not long_flags or action.dest == "help":
            continue
        name = ENV_PREFIX + long_flags[0][2:].replace("-", "_").upper()
        if name not in environ:
            continue
        action.default = env_default(action, name, environ[name], long_flags[0])


def env_default(action: argparse.Action, name: str, raw: str, flag: str):
    """One flag's default from its environment variable, or one line saying why not."""
    if isinstance(action, argparse._AppendAction):
        return [part for part in raw.split(",") if part]
    if isinstance(action, argparse._StoreTrueAction):
        return parse_bool(raw, name)
    try:
        if isinstance(action, argparse._CountAction):
            return int(raw or 0)
        return action.type(raw) if action.type else raw
    except ValueError:
        kind = "a whole number" if action.type is int or isinstance(
            action, argparse._CountAction) else "a number" if action.type is float else "valid"
        raise ConfigError(f"{name}={raw!r} is not {kind} (it sets {flag})") from None


def given_on_command_line(argv: list[str]) -> set[str]:
    """Destinations set by argv itself, so the command line can beat the environment."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    namespace, _ = parser.parse_known_args(argv)
    return set(vars(namespace))


def resolve_node_flags(args, explicit: set[str]) -> None:
    """--nnodes and --min/--max-nodes are two spellings; keep the command line's."""
    from_argv_nnodes = "nnodes" in explicit
    from_argv_minmax = bool({"min_nodes", "max_nodes"} & explicit)
    if from_argv_nnodes and from_argv_minmax:
        raise ConfigError("give either --nnodes or --min-nodes/--max-nodes, not both")
    if from_argv_nnodes:
        args.min_nodes = args.max_nodes = None
    elif from_argv_minmax:
        args.nnodes = None


def parse_nodes(args) -> tuple[int, int]:
    if args.nnodes and (args.min_nodes or args.max_nodes):
        raise ConfigError("give either --nnodes or --min-nodes/--max-nodes, not both")
    if args.standalone:
        return 1, 1
    if args.nnodes:
        lo, _, hi = args.nnodes.partition(":")
        try:
            low, high = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--nnodes {args.nnodes!r}: use N or MIN:MAX, e.g. 1:4") from None
    else:
        low = args.min_nodes if args.min_nodes is not None else 1
        high = args.max_nodes if args.max_nodes is not None else low
    if low < 1:
        raise ConfigError(f"--min-nodes {low}: need at least 1 node")
    if low > high:
        raise ConfigError(f"--min-nodes {low} is greater than --max-nodes {high}; "
                          "raise --max-nodes or lower --min-nodes")
    return low, high


def parse_label(text: str, flag: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag} {text!r}: use KEY=VALUE, e.g. zone=us-east-1c")
    return key.strip(), value.strip()


def parse_nproc(text: str, gpu_count: int) -> int:
    if text in ("auto", "gpu"):
        return gpu_count or 1
    if text == "cpu":
        return 1
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--nproc-per-node {text!r}: use a positive integer or 'auto'") from None
    if value < 1:
        raise ConfigError(f"--nproc-per-node {value}: need at least 1 worker per node")
    return value


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
        argv = (sys.executable, "-u", "-m", args.entrypoint, *args.args)
        digest.update(args.entrypoint.encode())
    else:
        script = Path(args.entrypoint)
        if not args.no_python and not script.is_file():
            raise ConfigError(f"script not found: {args.entrypoint} "
                              "(give a path to a .py file, or -m MODULE)")
        prefix = () if args.no_python else (sys.executable, "-u")
        argv = (*prefix, args.entrypoint, *args.args)
        if script.is_file():
            digest.update(script.read_bytes())
    for arg in args.args:
        digest.update(b"\0" + arg.encode())
    return argv, digest.hexdigest()[:16]


def default_node_id() -> str:
    return f"{os.uname().nodename}-{os.getpid()}"


def default_run_id(args) -> str:
    name = sanitize_id(Path(args.entrypoint).stem.replace(".", "-"))
    digest = hashlib.sha256("\0".join([args.entrypoint, *args.args]).encode()).hexdigest()
    return f"{name}-{digest[:8]}"


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


def read_password(args, environ: dict[str, str]) -> str | None:
    if args.etcd_password_file:
        try:
            return Path(args.etcd_password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --etcd-password-file: {exc.strerror}") from exc
    return environ.get(ENV_PREFIX + "ETCD_PASSWORD")


def count_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install must not stop a CPU run
        return 0


def build_config(args, environ: dict[str, str], gpu_count: int) -> AgentConfig:
    min_nodes, max_nodes = parse_nodes(args)
    nproc = parse_nproc(args.nproc_per_node, gpu_count)
    endpoints = tuple(e.strip() for e in (args.rdzv_endpoints or "").split(",") if e.strip())
    if args.standalone:
        endpoints = ()
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
    etcd = EtcdConfig(endpoints, args.etcd_timeout, max(2 * args.lease_ttl, 5.0),
                      args.etcd_cacert, args.etcd_cert, args.etcd_key, args.etcd_user,
                      read_password(args, environ), args.etcd_binary)
    rendezvous = RendezvousConfig(
        run_id, node_id, min_nodes, max_nodes, args.lease_ttl,
        args.join_timeout, args.settle, args.master_addr or local_address(endpoints),
        args.master_port, drain_timeout_s=args.notice_deadline + args.stop_grace, nproc=nproc,
        min_workers=args.min_workers, max_workers=args.max_workers,
        settle_max_s=args.settle_max if args.settle_max is not None
        else max(DEFAULT_SETTLE_MAX_S, args.settle),
        labels=tuple(sorted(parse_label(t, "--node-label") for t in args.node_label)),
        rank0_prefer=None if args.rank0_prefer in ("", "none")
        else parse_label(args.rank0_prefer, "--rank0-prefer"))
    if args.max_workers and args.max_workers < max(args.min_workers, nproc):
        raise ConfigError(f"--max-workers {args.max_workers} is below --min-workers or this "
                          f"node's {nproc} worker(s); raise --max-workers")
    workers = WorkerConfig(argv, nproc, fingerprint, args.stop_grace, args.monitor_interval,
                           log_dir, gpu_count,
                           worker_timeout_s=args.worker_timeout)
    verbosity = 0 if args.quiet else 1 + args.verbose
    return AgentConfig(rendezvous, etcd, workers, args.max_restarts, verbosity,
                       args.notice_deadline, Path(args.notice_file) if args.notice_file else None,
                       args.metrics_port, args.metrics_addr,
                       signals_to_handle(environ.get(SIGNALS_ENV, DEFAULT_SIGNALS_TO_HANDLE)),
                       cloud_notice=cloud_notice)


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


def parse_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    """Flags from argv, else from ELASTIC_RUN_* variables, else defaults."""
    parser = build_parser()
    apply_env_defaults(parser, environ)
    args = parser.parse_args(argv)
    resolve_node_flags(args, given_on_command_line(argv))
    return args


def setup_logging(verbosity: int, node_id: str) -> None:
    level = logging.ERROR if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[elastic-run {node_id}] %(message)s"))
    root = logging.getLogger("elastic_runner")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ)
    verbose = False  # the detail of an error, once -v is known to be ours (not the script's)
    try:
        if argv[:1] and argv[0] in SUBCOMMANDS:
            module = importlib.import_module(f"elastic_runner.cli.{SUBCOMMANDS[argv[0]]}")
            return module.main(argv[1:], environ)
        args = parse_args(argv, environ)
        verbose = args.verbose > 0
        config = build_config(args, environ, count_gpus() if args.nproc_per_node in
                              ("auto", "gpu") else 0)
        setup_logging(config.verbosity, config.rendezvous.node_id)
        from elastic_runner.agent.launch import launch
        return launch(config, environ)
    except ElasticRunError as exc:
        print(f"elastic-run: error: {exc}", file=sys.stderr)
        if verbose:
            logging.getLogger("elastic_runner").exception("detail")
        return exit_code_for(exc)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
