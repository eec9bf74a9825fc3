"""The launcher's flags, their environment-variable defaults, and what their text means.

Why a module of its own: `elastic-run` (cli/run.py), `status` and `deploy` parse the
same flags, and must read them identically; every verb imports them from here,
never from cli/main.py, so dispatch and the verbs cannot import each other.

Every flag --foo-bar can also come from ELASTIC_RUN_FOO_BAR; the command line wins
over the environment. The flags are described once, as `Flag` rows this module
owns, so the environment is read from those rows (which flag is a switch, a count,
a list) and handed to argparse through its public `set_defaults`, not by walking
argparse's internals.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from elastic_runner.agent.cloud_notice import CLOUDS
from elastic_runner.config import DEFAULT_ETCD_TIMEOUT_S, DEFAULT_SETTLE_MAX_S
from elastic_runner.errors import ConfigError, EXIT_CODES
from elastic_runner.validation import check_number, parse_bool, sanitize_id

ENV_PREFIX = "ELASTIC_RUN_"
SWALLOWED_VALUE = re.compile(r"(--[^=]+)=--|(-[^-])--")  # --flag=-- or -f--
PASSWORD_ENV = ENV_PREFIX + "ETCD_PASSWORD"


@dataclass(frozen=True)
class Flag:
    """One flag: its spellings and argparse options; its variable and parsing follow."""

    names: tuple[str, ...]
    options: Mapping[str, Any]

    @property
    def long_name(self) -> str:
        return next(n for n in self.names if n.startswith("--"))

    @property
    def dest(self) -> str:
        """argparse's rule: an explicit dest, else the first long name, dashes as underscores."""
        return self.options.get("dest") or self.long_name[2:].replace("-", "_")

    @property
    def env_name(self) -> str:
        return ENV_PREFIX + self.long_name[2:].replace("-", "_").upper()

    def from_env(self, raw: str) -> Any:
        """This flag's default from its environment variable, or one line saying why not."""
        action, kind = self.options.get("action"), self.options.get("type")
        if action == "append":
            return [part for part in raw.split(",") if part]
        if action == "store_true":
            return parse_bool(raw, self.env_name)
        try:
            if action == "count":
                return int(raw or 0)
            return kind(raw) if kind else raw
        except ValueError:
            what = "a whole number" if kind is int or action == "count" else \
                "a number" if kind is float else "valid"
            raise ConfigError(f"{self.env_name}={raw!r} is not {what} "
                              f"(it sets {self.long_name})") from None


def flag(*names: str, **options: Any) -> Flag:
    return Flag(names, MappingProxyType(options))


def add_flags(container, flags: Iterable[Flag]) -> None:
    """Add rows to a parser or an argument group."""
    for row in flags:
        container.add_argument(*row.names, **row.options)


def env_defaults(flags: Iterable[Flag], environ: Mapping[str, str]) -> dict[str, Any]:
    """{dest: value} for every flag whose ELASTIC_RUN_* variable is set."""
    return {row.dest: row.from_env(environ[row.env_name])
            for row in flags if row.env_name in environ}


# ---- the flags -----------------------------------------------------------------------
# Shared by every verb that talks to etcd: how to reach and authenticate to it.
ETCD_TIMEOUT = flag("--etcd-timeout", type=float, default=DEFAULT_ETCD_TIMEOUT_S,
                    help=f"seconds per etcd call (default {DEFAULT_ETCD_TIMEOUT_S:g})")
ETCD_ACCESS = (
    flag("--etcd-cacert", help="CA certificate for https endpoints"),
    flag("--etcd-cert", help="client certificate"),
    flag("--etcd-key", help="client key"),
    flag("--etcd-user", help="etcd user name"),
    flag("--etcd-password-file", help="file holding the etcd password "
         f"(or set {PASSWORD_ENV}; never a flag value)"),
)
MEMBERSHIP = (
    flag("--min-nodes", type=int, help="fewest nodes to train with (default 1)"),
    flag("--max-nodes", type=int, help="most nodes; extras wait as standbys "
         "(default: --min-nodes)"),
    flag("--nnodes", help="torchrun style: N or MIN:MAX"),
    flag("--nproc-per-node", "--nproc_per_node", default="1",
         help="workers per node: an integer, or 'auto' (one per GPU, else 1)"),
    flag("--node-id", help="this node's name in the run (default hostname-pid)"),
    flag("--min-workers", type=int, default=0,
         help="fewest workers (GPUs) in total to train with (default: no bound)"),
    flag("--max-workers", type=int, default=0,
         help="most workers in total; nodes that would exceed it wait as standbys"),
    flag("--node-label", action="append", default=[], metavar="KEY=VALUE",
         help="label this node (repeatable), e.g. zone=us-east-1c rack=r12 "
              "lifecycle=spot; nodes sharing a zone, then rack, get contiguous ranks"),
    flag("--rank0-prefer", default="lifecycle=on-demand", metavar="KEY=VALUE",
         help="put rank 0 on a member with this label when there is one "
              "(default lifecycle=on-demand; 'none' to disable)"),
)
RENDEZVOUS = (
    flag("--rdzv-endpoints", "--rdzv-endpoint", "--rdzv_endpoint",
         help="comma-separated etcd v3 URLs; absent: start an embedded local etcd"),
    flag("--run-id", "--rdzv-id", help="job name shared by its nodes "
         "(default: derived from the script name and arguments)"),
    flag("--lease-ttl", type=int, default=5,
         help="seconds before a crashed node is dropped (default 5)"),
    flag("--join-timeout", type=float, default=600.0,
         help="seconds to wait for --min-nodes before giving up (default 600)"),
    flag("--settle", type=float, default=2.0,
         help="a round with enough nodes closes after this many seconds "
              "with no new node (default 2)"),
    flag("--settle-max", type=float, help="longest a stream of arrivals may hold a round "
         f"open (default {DEFAULT_SETTLE_MAX_S:g}, or --settle if larger)"),
    flag("--suspect-grace", type=float, default=1.0,
         help="a round opened because a survivor's collective failed leaves out "
              "members that have not joined after this many seconds, instead of "
              "waiting --lease-ttl for a dead node (default 1)"),
    flag("--master-addr", help="address peers use to reach this node's "
         "process-group store (default: the interface that reaches etcd)"),
    flag("--master-port", type=int,
         help="fixed store port (default: a free port chosen each round)"),
    flag("--standalone", action="store_true", help="single node: embedded etcd, --nnodes 1"),
)
ETCD = (flag("--etcd-binary", help="etcd server for the embedded etcd"), ETCD_TIMEOUT,
        *ETCD_ACCESS)
WORKERS = (
    flag("--max-restarts", type=int, default=3,
         help="job-wide worker failures tolerated; membership changes don't count"),
    flag("--worker-timeout", type=float,
         help="restart the round when a worker's er.report() progress is older "
              "than this many seconds (a hung collective); default off"),
    flag("--prewarm", action="store_true",
         help="keep one Python per local worker with torch (and torch._dynamo, which the "
              "first optimizer imports) imported, ready for the next start: a restart "
              "skips both imports (one idle interpreter per worker)"),
    flag("--stop-grace", type=float, default=5.0,
         help="seconds between SIGTERM and SIGKILL when stopping workers"),
    flag("--monitor-interval", type=float, default=0.1,
         help="seconds between checks of worker processes"),
    flag("--notice-deadline", type=float, default=25.0,
         help="seconds a spot notice (SIGTERM) gives rank 0 to checkpoint the current "
              "step before this node's workers stop; 0 stops them at once"),
    flag("--notice-file", help="treat this file appearing as a spot notice "
         "(for cloud metadata watchers)"),
    flag("--notice-from", type=str.lower, choices=CLOUDS,
         help="poll this cloud's instance metadata service every 1-2 s and treat "
              "its spot notice as one (aws: spot/instance-action over IMDSv2; "
              "gcp: instance/preempted; azure: a Preempt scheduled event for "
              "this VM); an unreachable service is one warning, not a failure"),
    flag("--notice-url", metavar="URL",
         help="base URL of the metadata service for --notice-from (default: the "
              "cloud's own, http://169.254.169.254 or, for gcp, "
              "http://metadata.google.internal); for tests or a metadata relay"),
    flag("--log-dir", help="keep each worker's output in DIR/RUN_ID/roundN/rankR.log"),
    flag("-m", "--module", dest="module", action="store_true",
         help="run the entry point as a module (python -m)"),
    flag("--no-python", action="store_true", help="run the entry point as an executable"),
)
OUTPUT = (
    flag("--metrics-port", type=int,
         help="serve Prometheus metrics on this port (0: any free port)"),
    flag("--metrics-addr", default="0.0.0.0",
         help="address the metrics endpoint listens on (default 0.0.0.0, all "
              "interfaces, as Prometheus exporters do; 127.0.0.1 keeps it local)"),
    flag("-v", "--verbose", action="count", default=0, help="more detail"),
    flag("-q", "--quiet", action="store_true", help="errors only"),
)
RUN_GROUPS = (("membership", MEMBERSHIP), ("rendezvous", RENDEZVOUS), ("etcd", ETCD),
              ("workers", WORKERS), ("output", OUTPUT))
RUN_FLAGS = tuple(row for _, rows in RUN_GROUPS for row in rows)
# --nnodes and --min/--max-nodes are two spellings of one setting.
NODE_COUNT_DESTS = ("nnodes", "min_nodes", "max_nodes")


def build_parser() -> argparse.ArgumentParser:
    """The launcher's parser, without environment defaults (apply_env_defaults adds them)."""
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
    for title, rows in RUN_GROUPS:
        add_flags(parser.add_argument_group(title), rows)
    parser.add_argument("entrypoint", help="training script (or module with -m)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def apply_env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str],
                       flags: Iterable[Flag] = RUN_FLAGS) -> None:
    """Make each set ELASTIC_RUN_* variable the default of its flag in `parser`."""
    parser.set_defaults(**env_defaults(flags, environ))


def parse_args(argv: list[str], environ: Mapping[str, str]) -> argparse.Namespace:
    """Flags from argv, else from ELASTIC_RUN_* variables, else defaults."""
    parser = build_parser()
    apply_env_defaults(parser, environ)
    args = parse_checked(parser, argv)
    resolve_node_flags(args, node_flags_on_command_line(argv))
    return args


def parse_checked(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`parser.parse_args`, refusing a flag whose value argparse would swallow.

    Python 3.11's argparse (`ArgumentParser._get_values`) removes '--' from an option's
    strings before converting them, so `--log-dir=--` parses to [] and the flag's type
    never runs: the run would log into a folder named '[]'. Every verb parses through
    here, so no value of that shape gets past the command line.
    """
    args = parser.parse_args(argv)
    script = getattr(args, "args", None) or []  # the script's own words (a suffix of argv)
    ours = argv[:len(argv) - len(script)]
    ours = ours[:ours.index("--")] if "--" in ours else ours  # after it: positionals
    for token in ours:
        swallowed = SWALLOWED_VALUE.fullmatch(token)
        if swallowed:
            raise ConfigError(f"{swallowed.group(1) or swallowed.group(2)} got '--', which "
                              "argparse takes for 'end of flags', not a value: give it a real value")
    return args


def node_flags_on_command_line(argv: list[str]) -> set[str]:
    """Which of --nnodes/--min-nodes/--max-nodes argv itself sets.

    None of them has a default, so parsing argv without the environment leaves
    exactly those the command line gave set.
    """
    args, _ = build_parser().parse_known_args(argv)
    return {dest for dest in NODE_COUNT_DESTS if getattr(args, dest) is not None}


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


# ---- what a flag's text means ----------------------------------------------------------
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


def parse_nproc(text: str, gpu_count: int) -> int:
    if text in ("auto", "gpu"):
        return gpu_count or 1
    if text == "cpu":
        return 1
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--nproc-per-node {text!r}: use a positive integer or 'auto'") from None
    return check_number("nproc", value)


# A label travels in the plan to every node, which prints it (`node(zone=a,rack=r1)`):
# no spaces, '=' or ',' that would make that line ambiguous, no newline that would
# forge another. A superset of Kubernetes' label values.
_LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9._:/@+-]{0,128}")


def parse_label(text: str, flag_name: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not key:
        raise ConfigError(f"{flag_name} {text!r}: use KEY=VALUE, e.g. zone=us-east-1c")
    if not _LABEL_KEY.fullmatch(key):
        raise ConfigError(f"{flag_name} {text!r}: a key is 1-63 letters, digits, '.', '_', "
                          "'/' and '-', starting with a letter or digit")
    if not _LABEL_VALUE.fullmatch(value):
        raise ConfigError(f"{flag_name} {text!r}: a value is at most 128 letters, digits, "
                          "'.', '_', ':', '/', '@', '+' and '-'")
    return key, value


def parse_rank0_prefer(text: str | None) -> tuple[str, str] | None:
    """--rank0-prefer: a label, or '' / 'none' for no preference."""
    return None if text in (None, "", "none") else parse_label(text, "--rank0-prefer")


def parse_endpoints(text: str | None) -> tuple[str, ...]:
    """--rdzv-endpoints: comma-separated, blanks dropped (checked by the caller)."""
    return tuple(e.strip() for e in (text or "").split(",") if e.strip())


def default_run_id(args) -> str:
    name = sanitize_id(Path(args.entrypoint).stem.replace(".", "-"))
    digest = hashlib.sha256("\0".join([args.entrypoint, *args.args]).encode()).hexdigest()
    return f"{name}-{digest[:8]}"


def read_password(args, environ: Mapping[str, str]) -> str | None:
    """--etcd-password-file, else ELASTIC_RUN_ETCD_PASSWORD: never a flag value, which
    would show in `ps` and shell history."""
    if args.etcd_password_file:
        try:
            return Path(args.etcd_password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --etcd-password-file: {exc.strerror}") from exc
    return environ.get(PASSWORD_ENV)
