"""`elastic-run deploy kubernetes|slurm`: render what runs a job at scale.

Why a renderer: the manifests and the sbatch script must carry exactly the
launcher flags a user would type (node range, workers, run id, notice deadline)
plus values derived from them (the pod's termination grace period, Slurm's
signal lead time). Rendering from the launcher's own parser keeps the two from
drifting; the files under deploy/ are this module's output for documented flags.

Choices, written down:
- Only the command line is read. ELASTIC_RUN_* variables describe *this* machine,
  not the cluster, so they are ignored: the same argv always renders the same text.
- Nothing is applied: `--dryrun` prints, `--output DIR` writes. kubectl/sbatch are
  never called.
- YAML comes from plain dicts through `yaml.safe_dump_all`; the sbatch script is the
  template file cli/templates/slurm.sbatch (package data) with `@@{name}` placeholders,
  filled with values quoted for bash. Names are validated, every other value is quoted
  for its target: see deploy_quoting (issue 12: a newline in a flag must not add a line
  or a document).
- Flags the deployment sets per pod/node (--node-id, --master-addr, --standalone)
  are refused; --rdzv-endpoints means "use my etcd" (no etcd objects rendered).
- --grpc-proxies N (kubernetes) puts N etcd gRPC proxies between the pods and etcd
  (ours or --rdzv-endpoints); the pods are pointed at the proxies' Service.
"""

from __future__ import annotations

import argparse
import math
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from elastic_runner.cli.flags import (
    RUN_FLAGS, build_parser, default_run_id, parse_checked, parse_label, parse_nodes,
    parse_nproc, parse_rank0_prefer)
from elastic_runner.cli.deploy_quoting import (
    PARTITION, TIME, check_dns_label, check_grammar, check_id, check_text, kube_literal,
    printable, shell_join, shell_quote)
from elastic_runner.errors import ConfigError

KINDS = ("kubernetes", "slurm")
ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
ETCD_MEMBERS = 3
PROXY_PORT = 23790  # etcd grpc-proxy's own default
SHUTDOWN_MARGIN_S = 10  # process exits and the lease revoke's round trip, beyond --etcd-timeout
SLURM_MIN_SIGNAL_S = 60
YAML_WIDTH = 2**31 - 1  # PyYAML folds lines longer than this
# Set per pod or node by the deployment itself; a fixed value would be wrong on all but one.
REFUSED = {"node_id": "--node-id", "master_addr": "--master-addr", "standalone": "--standalone"}
# Rendered explicitly (or refused) rather than passed through.
HANDLED = {"help", "min_nodes", "max_nodes", "nnodes", "nproc_per_node", "rdzv_endpoints",
           "run_id", "module", "entrypoint", "args", *REFUSED}


@dataclass(frozen=True)
class DeploySpec:
    """Everything a renderer needs, validated once; `args` holds the deploy group's flags."""

    kind: str
    command: str  # the deploy command line, recorded in each file's header
    args: argparse.Namespace
    image: str
    replicas: int
    min_nodes: int
    max_nodes: int
    run_id: str | None  # None: slurm uses $SLURM_JOB_ID
    endpoints: tuple[str, ...]
    grace_s: int
    passthrough: tuple[str, ...]
    entry: tuple[str, ...]


# ---- argument parsing ---------------------------------------------------------------
def deploy_parser(kind: str) -> argparse.ArgumentParser:
    """The launcher's parser plus a deploy group, so launcher flags parse identically."""
    parser = build_parser()
    parser.prog = f"elastic-run deploy {kind}"

    def fail(message: str) -> None:
        raise ConfigError(printable(f"deploy {kind}: {message}"))

    parser.error = fail  # type: ignore[method-assign]  # one line, exit 2, via cli.main
    group = parser.add_argument_group("deploy")
    group.add_argument("--dryrun", "--dry-run", action="store_true", help="print, write nothing")
    group.add_argument("--output", help="directory to write the files to (without --dryrun)")
    group.add_argument("--name", default="elastic-train", help="Deployment / Slurm job name")
    group.add_argument("--image", help="container image (kubernetes)")
    group.add_argument("--etcd-image", default=ETCD_IMAGE, help="etcd image (kubernetes)")
    group.add_argument("--namespace", help="namespace for every object (kubernetes)")
    group.add_argument("--replicas", type=int, help="pods / nodes to start (default --max-nodes)")
    group.add_argument("--gpus-per-node", type=int, default=0, help="nvidia.com/gpu per pod/node")
    group.add_argument("--cpus", help="CPU request per pod, e.g. 4 or 500m (kubernetes)")
    group.add_argument("--memory", help="memory request and limit per pod, e.g. 8Gi (kubernetes)")
    group.add_argument("--partition", help="Slurm partition")
    group.add_argument("--time", help="Slurm time limit, e.g. 24:00:00")
    group.add_argument("--grpc-proxies", type=int, default=0, metavar="N",
                       help="run N etcd gRPC proxies between the nodes and etcd, for hundreds "
                            "of nodes (kubernetes; README 'Deploying')")
    return parser


def recorded_command(kind: str, argv: list[str], args: argparse.Namespace) -> str:
    """The deploy command minus --dryrun/--output: the files are the same either way."""
    flags, tail = argv[:len(argv) - len(args.args) - 1], argv[len(argv) - len(args.args) - 1:]
    kept: list[str] = []
    skip = False
    for token in flags:
        if skip or token in ("--dryrun", "--dry-run"):
            skip = False
            continue
        if token == "--output":
            skip = True
            continue
        if not token.startswith("--output="):
            kept.append(token)
    return shell_join(["elastic-run", "deploy", kind, *kept, *tail])


def format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# argparse's default for a switch given no `default=`.
SWITCH_DEFAULTS = {"store_true": False, "store_false": True}


def passthrough_flags(args: argparse.Namespace) -> list[str]:
    """Launcher flags that differ from their defaults, in canonical long spelling.

    Read from the flag table (flags.RUN_FLAGS), not from argparse's private actions."""
    flags: list[str] = []
    for row in RUN_FLAGS:
        if row.dest in HANDLED:
            continue
        value = getattr(args, row.dest)
        action = row.options.get("action")
        if value == row.options.get("default", SWITCH_DEFAULTS.get(action)):
            continue
        if action == "count":
            flags += [row.long_name] * value
        elif action in SWITCH_DEFAULTS:
            flags.append(row.long_name)
        else:
            for item in value if action == "append" else [value]:
                text = format_value(item)
                # "--log-dir -x" would read -x as a flag; "--log-dir=-x" cannot.
                flags += [f"{row.long_name}={text}"] if text.startswith("-") else \
                    [row.long_name, text]
    return flags


def grace_period(notice_deadline: float, stop_grace: float, etcd_timeout: float) -> int:
    """Seconds between SIGTERM and SIGKILL that fit a whole spot-notice exit."""
    return math.ceil(notice_deadline + stop_grace + etcd_timeout + SHUTDOWN_MARGIN_S)


def check_args(kind: str, args: argparse.Namespace, min_nodes: int) -> None:
    for dest, flag in REFUSED.items():
        if getattr(args, dest):
            raise ConfigError(f"deploy {kind}: {flag} is set per node by the deployment; drop it")
    if args.replicas is not None and args.replicas < (min_nodes if kind == "slurm" else 0):
        raise ConfigError(f"deploy {kind}: --replicas {args.replicas} is below --min-nodes "
                          f"{min_nodes}; a Slurm allocation cannot grow later")
    if args.gpus_per_node < 0:
        raise ConfigError(f"deploy {kind}: --gpus-per-node {args.gpus_per_node}: need 0 or more")
    nproc = parse_nproc(args.nproc_per_node, args.gpus_per_node)
    if args.gpus_per_node and nproc > args.gpus_per_node:
        raise ConfigError(f"deploy {kind}: --nproc-per-node {nproc} is more than "
                          f"--gpus-per-node {args.gpus_per_node}; each worker needs its own GPU")
    for flag, value in (("--image", args.image), ("--namespace", args.namespace),
                        ("--cpus", args.cpus), ("--memory", args.memory)):
        if kind == "slurm" and value:
            raise ConfigError(f"deploy slurm: {flag} is for kubernetes only")
    for flag, value in (("--partition", args.partition), ("--time", args.time)):
        if kind == "kubernetes" and value:
            raise ConfigError(f"deploy kubernetes: {flag} is for slurm only")
    check_proxies(kind, args)
    check_labels(args)
    if not args.dryrun and not args.output:
        raise ConfigError(f"deploy {kind}: give --output DIR to write the files, or --dryrun to print them")
    check_names(kind, args)


def check_labels(args: argparse.Namespace) -> None:
    """Every agent refuses a label outside parse_label's grammar when it starts: a
    deployment carrying one would only restart its pods over and over."""
    for text in args.node_label:
        parse_label(text, "--node-label")
    parse_rank0_prefer(args.rank0_prefer)


def check_proxies(kind: str, args: argparse.Namespace) -> None:
    if not args.grpc_proxies:
        return
    if kind == "slurm":
        raise ConfigError("deploy slurm: --grpc-proxies is for kubernetes only")
    if args.grpc_proxies < 0:
        raise ConfigError(f"deploy kubernetes: --grpc-proxies {args.grpc_proxies}: need 0 or more")
    if any(e.strip().startswith("https://") for e in (args.rdzv_endpoints or "").split(",")):
        raise ConfigError("deploy kubernetes: --grpc-proxies with a TLS etcd is not rendered "
                          "(the proxies would need its certificates); run them yourself")


def check_names(kind: str, args: argparse.Namespace) -> None:
    """Values that name things or sit in #SBATCH lines are validated, not quoted."""
    if args.run_id is not None:
        check_id(kind, "--run-id", args.run_id)
    if kind == "kubernetes":
        check_dns_label("--name", args.name)
        if args.namespace is not None:
            check_dns_label("--namespace", args.namespace)
        return
    check_id(kind, "--name", args.name)  # also the job name and the script's file name
    if args.partition is not None:
        check_grammar("--partition", args.partition, PARTITION, "a partition name such as gpu")
    if args.time is not None:
        check_grammar("--time", args.time, TIME, "a Slurm time such as 24:00:00 or 2-00:00:00")


def parse_spec(argv: list[str]) -> tuple[DeploySpec, argparse.Namespace]:
    if not argv or argv[0] not in KINDS:
        raise ConfigError("deploy: say what to render: `elastic-run deploy kubernetes|slurm "
                          "--dryrun [launcher flags] train.py [args]`")
    kind, rest = argv[0], argv[1:]
    check_text(rest)
    parser = deploy_parser(kind)
    args = parse_checked(parser, rest)
    try:
        min_nodes, max_nodes = parse_nodes(args)
        check_args(kind, args, min_nodes)
    except ConfigError as exc:  # messages may quote a value; keep them on one line
        raise type(exc)(printable(str(exc))) from exc
    endpoints = tuple(e.strip() for e in (args.rdzv_endpoints or "").split(",") if e.strip())
    run_id = args.run_id or (default_run_id(args) if kind == "kubernetes" else None)
    spec = DeploySpec(
        kind, recorded_command(kind, rest, args), args, args.image or "elastic-runner:cpu",
        max_nodes if args.replicas is None else args.replicas, min_nodes, max_nodes, run_id,
        endpoints, grace_period(args.notice_deadline, args.stop_grace, args.etcd_timeout),
        tuple(passthrough_flags(args)),
        script_command(args))
    return spec, args


def script_command(args: argparse.Namespace) -> tuple[str, ...]:
    """The entrypoint and its arguments as the agent's command line must spell them.

    argparse drops the first '--' after the entrypoint (`train.py -- --lr 1` gives the
    script `--lr 1`), so a script argument list that itself starts with '--' (the user
    typed `train.py -- -- x`) needs that '--' written twice to reach the script.
    """
    escape = ("--",) if args.args[:1] == ["--"] else ()
    return (*(("--module",) if args.module else ()), args.entrypoint, *escape, *args.args)


# ---- kubernetes ---------------------------------------------------------------------
def metadata(spec: DeploySpec, name: str, app: str) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": app,
                                                     "app.kubernetes.io/part-of": "elastic-runner"}}
    if spec.args.namespace:
        meta["namespace"] = spec.args.namespace
    return meta


def etcd_urls(port: int) -> list[str]:
    return [f"http://etcd-{i}.etcd:{port}" for i in range(ETCD_MEMBERS)]


def etcd_objects(spec: DeploySpec) -> list[dict]:
    """3 members addressed by stable pod DNS names; the PDB keeps quorum during drains."""
    selector = {"app.kubernetes.io/name": "etcd"}
    ports = [{"name": "client", "port": 2379}, {"name": "peer", "port": 2380}]
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, "etcd", "etcd"),
                # Members must resolve each other before they are Ready (no quorum yet).
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                         "selector": selector, "ports": ports}}
    client = {"apiVersion": "v1", "kind": "Service",
              "metadata": metadata(spec, "etcd-client", "etcd"),
              "spec": {"selector": selector, "ports": ports[:1]}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
           "metadata": metadata(spec, "etcd", "etcd"),
           "spec": {"minAvailable": ETCD_MEMBERS // 2 + 1, "selector": {"matchLabels": selector}}}
    cluster = ",".join(f"etcd-{i}=http://etcd-{i}.etcd:2380" for i in range(ETCD_MEMBERS))
    container = {
        "name": "etcd", "image": spec.args.etcd_image, "command": ["/usr/local/bin/etcd"],
        "args": ["--name=$(POD_NAME)", "--data-dir=/var/run/etcd/data",
                 "--listen-client-urls=http://0.0.0.0:2379", "--listen-peer-urls=http://0.0.0.0:2380",
                 "--advertise-client-urls=http://$(POD_NAME).etcd:2379",
                 "--initial-advertise-peer-urls=http://$(POD_NAME).etcd:2380",
                 f"--initial-cluster={cluster}", "--initial-cluster-state=new",
                 "--initial-cluster-token=elastic-runner-etcd",
                 "--auto-compaction-mode=periodic", "--auto-compaction-retention=1h"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "client", "containerPort": 2379}, {"name": "peer", "containerPort": 2380}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 2379}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/var/run/etcd"}],
    }
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(spec, "etcd", "etcd"),
        "spec": {"serviceName": "etcd", "replicas": ETCD_MEMBERS,
                 # All members must be up together for the initial cluster to form.
                 "podManagementPolicy": "Parallel", "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": dict(selector)},
                              "spec": {"containers": [container]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                     "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}}}]}}
    return [headless, client, pdb, statefulset]


def proxy_objects(spec: DeploySpec) -> list[dict]:
    """Stateless `etcd grpc-proxy` pods behind one Service (README "Deploying"): they
    merge the nodes' watches and keep-alives, so etcd serves a few proxies instead of
    every node. A CPU of their own each: a starved proxy lets many leases lapse at once."""
    upstream = ",".join(url.split("://", 1)[-1] for url in spec.endpoints or etcd_urls(2379))
    selector = {"app.kubernetes.io/name": "etcd-proxy"}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": metadata(spec, "etcd-proxy", "etcd-proxy"),
               "spec": {"selector": selector, "ports": [{"name": "client", "port": PROXY_PORT}]}}
    container = {
        "name": "etcd-proxy", "image": spec.args.etcd_image, "command": ["/usr/local/bin/etcd"],
        "args": ["grpc-proxy", "start", f"--endpoints={kube_literal(upstream)}",
                 f"--listen-addr=0.0.0.0:{PROXY_PORT}",
                 f"--advertise-client-url=$(POD_IP):{PROXY_PORT}"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "client", "containerPort": PROXY_PORT}],
        "readinessProbe": {"tcpSocket": {"port": PROXY_PORT}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "1", "memory": "256Mi"}},
    }
    spread = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"labelSelector": {"matchLabels": dict(selector)},
                                           "topologyKey": "kubernetes.io/hostname"}}]}}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(spec, "etcd-proxy", "etcd-proxy"),
        "spec": {"replicas": spec.args.grpc_proxies, "selector": {"matchLabels": selector},
                 "template": {"metadata": {"labels": dict(selector)},
                              "spec": {"containers": [container], "affinity": spread}}}}
    return [service, deployment]


def launcher_args(spec: DeploySpec, endpoints: str, run_id: str, per_node: list[str]) -> list[str]:
    """The agent's argv in a pod; user values escaped for Kubernetes' $(VAR) expansion."""
    return ["--min-nodes", str(spec.min_nodes), "--max-nodes", str(spec.max_nodes),
            "--nproc-per-node", "$(NPROC_PER_NODE)", "--rdzv-endpoints", kube_literal(endpoints),
            "--run-id", run_id, *per_node,
            *(kube_literal(a) for a in (*spec.passthrough, *spec.entry))]


def train_resources(spec: DeploySpec) -> dict:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.args.cpus:
        requests["cpu"] = spec.args.cpus
    if spec.args.memory:
        requests["memory"] = limits["memory"] = spec.args.memory
    if spec.args.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.args.gpus_per_node
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def train_deployment(spec: DeploySpec) -> dict:
    """Pods are interchangeable nodes: scale with `kubectl scale`, ranks come from etcd."""
    endpoints = (f"http://etcd-proxy:{PROXY_PORT}" if spec.args.grpc_proxies
                 else ",".join(spec.endpoints or etcd_urls(2379)))
    per_node = ["--node-id", "$(POD_NAME)", "--master-addr", "$(POD_IP)"]
    container: dict[str, Any] = {
        "name": "elastic-run", "image": spec.image, "command": ["elastic-run"],
        "args": launcher_args(spec, endpoints, spec.run_id or spec.args.name, per_node),
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                # An env var, so an overlay can change it with a strategic-merge patch.
                {"name": "NPROC_PER_NODE", "value": kube_literal(spec.args.nproc_per_node)},
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "resources": train_resources(spec),
        # torch workers share tensors through /dev/shm; the container default is 64 MiB.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod: dict[str, Any] = {
        # SIGTERM -> notice deadline -> worker stop grace -> lease revoke, then SIGKILL.
        "terminationGracePeriodSeconds": spec.grace_s, "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    if spec.args.gpus_per_node:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    selector = {"app.kubernetes.io/name": spec.args.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": metadata(spec, spec.args.name, spec.args.name),
            # Recreate: a rolling update would mix two job specs in one run id.
            "spec": {"replicas": spec.replicas, "strategy": {"type": "Recreate"},
                     "selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": dict(selector)}, "spec": pod}}}


def header(spec: DeploySpec) -> str:
    # spec.command is shell_join'ed: printable, so it cannot end the comment line.
    return (f"# Rendered by: {spec.command}\n"
            "# Re-render with other flags rather than editing by hand.\n")


def yaml_documents(objects: list[dict], spec: DeploySpec) -> str:
    """The header comment, then one `---` document per object, by PyYAML's safe dumper.

    allow_unicode=False: anything beyond printable ASCII is escaped in a double-quoted
    scalar, so no line break (\\x85, \\u2028, ...) reaches the text unescaped. An unbounded
    width keeps each value on one line instead of folding it.
    """
    return header(spec) + yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True,
                                             allow_unicode=False, width=YAML_WIDTH)


def kubernetes_files(spec: DeploySpec) -> dict[str, str]:
    files = {}
    if not spec.endpoints:
        files["etcd.yaml"] = yaml_documents(etcd_objects(spec), spec)
    if spec.args.grpc_proxies:
        files["etcd-proxy.yaml"] = yaml_documents(proxy_objects(spec), spec)
    files["train.yaml"] = yaml_documents([train_deployment(spec)], spec)
    kustomization: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                     "kind": "Kustomization", "resources": list(files)}
    files["kustomization.yaml"] = header(spec) + yaml.safe_dump(
        kustomization, sort_keys=False, allow_unicode=False, width=YAML_WIDTH)
    return files


def kubernetes_stream(spec: DeploySpec) -> str:
    objects = ([] if spec.endpoints else etcd_objects(spec)) \
        + (proxy_objects(spec) if spec.args.grpc_proxies else []) + [train_deployment(spec)]
    return yaml_documents(objects, spec)


# ---- slurm --------------------------------------------------------------------------
def slurm_script(spec: DeploySpec) -> str:
    directives = [f"--job-name={spec.args.name}", f"--nodes={spec.replicas}", "--ntasks-per-node=1",
                  "--exclusive", "--no-kill", "--requeue",
                  f"--signal=B:TERM@{max(SLURM_MIN_SIGNAL_S, spec.grace_s)}",
                  f"--output={spec.args.name}-%j.out", "--open-mode=append"]
    directives += [f"--gpus-per-node={spec.args.gpus_per_node}"] if spec.args.gpus_per_node else []
    directives += [f"--partition={spec.args.partition}"] if spec.args.partition else []
    directives += [f"--time={spec.args.time}"] if spec.args.time else []
    core = shell_join(["--min-nodes", str(spec.min_nodes), "--max-nodes", str(spec.max_nodes),
                       "--nproc-per-node", spec.args.nproc_per_node])
    lines = [core + ' --rdzv-endpoints "$ETCD_ENDPOINTS" --run-id "$RUN_ID"',
             shell_join(spec.passthrough), shell_join(spec.entry)]
    return SlurmTemplate(slurm_template()).substitute(
        header=header(spec).rstrip("\n"),
        directives="\n".join(f"#SBATCH {d}" for d in directives),
        run_id=shell_quote(spec.run_id) if spec.run_id else '"$SLURM_JOB_ID"',
        endpoints=shell_quote(",".join(spec.endpoints)) if spec.endpoints else "",
        command=" \\\n    ".join(line for line in lines if line), grace=spec.grace_s)


class SlurmTemplate(string.Template):
    """`@@{name}` placeholders: the template is a bash script full of `$`, which
    stays as written (string.Template's default `$name` would need each one doubled)."""

    delimiter = "@@"


def slurm_template() -> str:
    """The sbatch script's text, shipped as package data (cli/templates/slurm.sbatch)."""
    return (resources.files("elastic_runner.cli") / "templates" / "slurm.sbatch").read_text("utf-8")


# ---- entry point --------------------------------------------------------------------
def render(spec: DeploySpec) -> dict[str, str]:
    """File name -> text; the dry run prints the same content as one stream."""
    if spec.kind == "slurm":
        return {f"{spec.args.name}.sbatch": slurm_script(spec)}
    return kubernetes_files(spec)


def write_files(directory: Path, files: dict[str, str]) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text)
    except OSError as exc:
        raise ConfigError(f"deploy: cannot write to --output {directory}: {exc.strerror}") from exc


def main(argv: list[str], environ: dict[str, str]) -> int:
    """Render; print with --dryrun, else write to --output. `environ` is unused on purpose."""
    spec, args = parse_spec(argv)
    if args.dryrun:
        print(slurm_script(spec) if spec.kind == "slurm" else kubernetes_stream(spec), end="")
        return 0
    files = render(spec)
    write_files(Path(args.output), files)
    for name in files:
        print(Path(args.output) / name)
    return 0
