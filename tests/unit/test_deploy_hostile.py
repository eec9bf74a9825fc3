"""`elastic-run deploy` with hostile values (issue 12, defect 7).

Every value the renderer writes is either refused (exit 2, one line, nothing
printed) or lands in its file as one inert value:

- sbatch: the script is run by bash with stub `scontrol`/`srun` (srun records its
  argv); the launcher's own parser must read back exactly the values given, no
  marker file may appear, and the `# Rendered by:` header stays one line that
  bash evaluates back to the deploy command.
- Kubernetes: `yaml.safe_load_all` must yield exactly the expected documents, and
  the container args, after Kubernetes' own `$(VAR)` expansion, must parse back
  to the values given.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings, strategies as st

from elastic_runner.cli import deploy, deploy_quoting, flags, main as cli
from elastic_runner.errors import ConfigError
from elastic_runner.ids import id_problem

MARKER = "PWNED"
HOSTILE = [
    "a\nb",
    "x\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: evil}",
    f"x\ntouch {MARKER}",
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"x'$(touch {MARKER})'",
    f'"; touch {MARKER}; "',
    "it's \"quoted\"",
    "# not a comment",
    "---",
    "...",
    "key: value",
    "{a: 1}",
    "[1, 2]",
    "a\rb",
    "a\r\nb",
    "line\u2028sep",
    "para\u2029sep",
    "next\x85line",
    "tab\there\x0bvt\x0cff",
    "\x1b[31mred",
    "\ufeffbom",
    "back\\slash\\",
    "- item",
    "*alias",
    "&anchor",
    "!!python/object/apply:os.system",
    "%YAML 1.1",
    "? key",
    "| block",
    "@E@ @R@",
    " padded ",
    "null",
    "~",
    "0x10",
    "true",
    "é ünïcode ✓ 𝄞",
    "$(POD_NAME)",
    "$$(POD_NAME)",
    "$",
    "a$",
    "${HOME}",
    "$HOME",
    "}",
    "-x",
    "--log-dir",
]
IDS = [ascii(v)[1:-1][:40] for v in HOSTILE]
BAD_NAMES = [v for v in HOSTILE if id_problem(v)] + ["../../etc/passwd", "a/b", "a..b", "x" * 129]
K8S_ENV = {"POD_NAME": "pod-0", "POD_IP": "10.1.2.3", "NPROC_PER_NODE": "1", "PYTHONUNBUFFERED": "1"}


def render(argv: list[str], capsys) -> str:
    assert deploy.main(argv, {}) == 0
    return capsys.readouterr().out


def assert_refused(argv: list[str], message: str, capsys) -> None:
    """ConfigError from the verb; through the CLI: exit 2, one line on stderr, no stdout."""
    with pytest.raises(ConfigError, match=message):
        deploy.main(argv, {})
    capsys.readouterr()
    assert cli.main(["deploy", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.endswith("\n") and err.startswith("elastic-run: error: ")
    assert all(c.isprintable() for c in err[:-1]), err


def label_ok(value: str) -> bool:
    """Whether `value` is a label value every agent takes (flags.parse_label)."""
    try:
        flags.parse_label(f"k={value}", "--node-label")
    except ConfigError:
        return False
    return True


REFUSED_LABELS = [v for v in HOSTILE if not label_ok(v)]


def free_flags(value: str) -> list[str]:
    """Launcher flags deploy passes through, each set to `value` (`=`: it may start with -);
    a label only where its grammar takes it (the rest: test_hostile_labels_are_refused)."""
    labels = [f"--node-label=k={value}", f"--rank0-prefer=k={value}"] if label_ok(value) else []
    return [f"--log-dir={value}", f"--notice-file={value}", f"--etcd-user={value}", *labels]


def assert_agent_reads(agent_argv: list[str], value: str, script: str, run_id: str) -> None:
    """The launcher, given the rendered argv, sees every value exactly as typed."""
    args = flags.build_parser().parse_args(agent_argv)
    assert (args.log_dir, args.notice_file, args.etcd_user) == (value,) * 3
    if label_ok(value):
        assert (args.node_label, args.rank0_prefer) == ([f"k={value}"], f"k={value}")
    assert (args.entrypoint, args.args) == (script, [value, "--lr", value])
    assert args.run_id == run_id and id_problem(run_id) is None


# ---- Kubernetes ------------------------------------------------------------------------
def kube_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command/args/env (third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(" and ")" in text[i + 2:]:
            end = text.index(")", i + 2)
            name = text[i + 2:end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def test_kube_expand_models_kubernetes():
    assert kube_expand("$(POD_NAME)-$$(POD_NAME)-$(NOPE)-$x-$", K8S_ENV) == "pod-0-$(POD_NAME)-$(NOPE)-$x-$"
    assert kube_expand(deploy_quoting.kube_literal("$$($(POD_IP)$"), K8S_ENV) == "$$($(POD_IP)$"


def k8s_documents(text: str) -> list[dict]:
    assert all(c == "\n" or c.isprintable() for c in text)  # no line break but \n, anywhere
    assert all(line.isascii() for line in text.splitlines() if not line.startswith("#"))
    docs = list(yaml.safe_load_all(text))
    assert all(isinstance(d, dict) for d in docs), docs
    # kubectl splits a stream on lines that start with "---" before any YAML parsing.
    separators = [line for line in text.splitlines() if line.startswith(("---", "..."))]
    assert separators == ["---"] * len(docs) or (separators, len(docs)) == ([], 1), separators
    return docs


def k8s_render(value: str, capsys, *extra: str) -> tuple[list[dict], list[str]]:
    argv = ["kubernetes", "--dryrun", *extra, *free_flags(value), "train.py", value, "--lr", value]
    docs = k8s_documents(render(argv, capsys))
    return docs, argv


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_kubernetes_free_values_stay_one_value(value, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    image = value or "x"
    docs, _ = k8s_render(value, capsys, f"--image={image}", f"--etcd-image={image}",
                         f"--cpus={image}", f"--memory={image}")
    assert [d["kind"] for d in docs] == ["Service", "Service", "PodDisruptionBudget",
                                         "StatefulSet", "Deployment"]
    etcd = docs[3]["spec"]["template"]["spec"]["containers"][0]
    pod = docs[4]["spec"]["template"]["spec"]["containers"][0]
    assert etcd["image"] == pod["image"] == image
    assert pod["resources"] == {"requests": {"cpu": image, "memory": image},
                                "limits": {"memory": image}}
    env = {e["name"]: e.get("value") for e in pod["env"]}
    agent_argv = [kube_expand(a, {**K8S_ENV, **{k: v for k, v in env.items() if v}}) for a in pod["args"]]
    assert agent_argv[agent_argv.index("--node-id") + 1] == "pod-0"
    assert_agent_reads(agent_argv, value, "train.py", agent_argv[agent_argv.index("--run-id") + 1])
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_kubernetes_endpoints_and_entrypoint_stay_one_value(value, capsys):
    endpoints = f"http://e:2379,{value}"
    docs, _ = k8s_render(value, capsys, f"--rdzv-endpoints={endpoints}", "--run-id=job7")
    assert [d["kind"] for d in docs] == ["Deployment"]
    args = docs[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    agent = flags.build_parser().parse_args([kube_expand(a, K8S_ENV) for a in args])
    assert agent.rdzv_endpoints == ",".join(e.strip() for e in endpoints.split(",") if e.strip())
    script = f"train{value}.py"
    docs = k8s_documents(render(["kubernetes", "--dryrun", script, value], capsys))
    agent = flags.build_parser().parse_args(
        [kube_expand(a, K8S_ENV) for a in docs[-1]["spec"]["template"]["spec"]["containers"][0]["args"]])
    assert (agent.entrypoint, agent.args) == (script, [value])
    assert id_problem(agent.run_id) is None  # derived from the script name, sanitized


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_kubernetes_files_hold_their_documents(value, capsys, tmp_path):
    out = tmp_path / "out"
    assert deploy.main(["kubernetes", "--output", str(out), f"--image={value or 'x'}",
                        "train.py", value], {}) == 0
    counts = {p.name: len(k8s_documents(p.read_text())) for p in out.iterdir()}
    assert counts == {"etcd.yaml": 4, "train.yaml": 1, "kustomization.yaml": 1}
    assert yaml.safe_load((out / "kustomization.yaml").read_text())["resources"] == \
        ["etcd.yaml", "train.yaml"]


# ---- labels and names are refused --------------------------------------------------------
@pytest.mark.parametrize("kind", ["kubernetes", "slurm"])
@pytest.mark.parametrize("value", REFUSED_LABELS, ids=[ascii(v)[1:-1][:40] for v in REFUSED_LABELS])
def test_hostile_labels_are_refused(kind, value, capsys):
    """Every agent would refuse them at its start: deploy refuses them first. (The
    hostile values the grammar takes, `true`, `-x`, `--log-dir`, ride free_flags.)"""
    assert_refused([kind, "--dryrun", f"--node-label=zone={value}", "train.py"],
                   "--node-label", capsys)
    assert_refused([kind, "--dryrun", f"--rank0-prefer=zone={value}", "train.py"],
                   "--rank0-prefer", capsys)


def test_labels_the_agent_takes_are_rendered(capsys):
    assert deploy.main(["kubernetes", "--dryrun", "--node-label=zone=us-east-1c",
                        "--rank0-prefer=lifecycle=on-demand", "train.py"], {}) == 0
    out = capsys.readouterr().out
    assert "zone=us-east-1c" in out


@pytest.mark.parametrize("kind", ["kubernetes", "slurm"])
@pytest.mark.parametrize("value", BAD_NAMES, ids=[ascii(v)[1:-1][:40] for v in BAD_NAMES])
def test_bad_run_ids_and_names_are_refused(kind, value, capsys):
    assert_refused([kind, "--dryrun", f"--run-id={value}", "train.py"], "--run-id .* not a valid id",
                   capsys)
    assert_refused([kind, "--dryrun", f"--name={value}", "train.py"], "--name .* not a valid", capsys)


@pytest.mark.parametrize("value", ["Train", "a_b", "a.b", "-a", "a-", "x" * 64, "", "null\n"])
def test_kubernetes_names_must_be_dns_labels(value, capsys):
    assert_refused(["kubernetes", "--dryrun", f"--name={value}", "train.py"],
                   "--name .* not a valid Kubernetes name", capsys)
    assert_refused(["kubernetes", "--dryrun", f"--namespace={value}", "train.py"],
                   "--namespace .* not a valid Kubernetes name", capsys)


def test_slurm_name_never_leaves_the_output_directory(tmp_path, capsys):
    assert_refused(["slurm", "--output", str(tmp_path / "o"), "--name=../../escape", "train.py"],
                   "not a valid id", capsys)
    assert not list(tmp_path.rglob("*"))


@pytest.mark.parametrize("value", HOSTILE + ["gpu debug", "gpu,", "=x"], ids=IDS + ["space", "comma", "eq"])
def test_hostile_sbatch_directives_are_refused(value, capsys):
    if re.fullmatch(deploy_quoting.PARTITION, value) is None:
        assert_refused(["slurm", "--dryrun", f"--partition={value}", "train.py"],
                       "--partition .* #SBATCH", capsys)
    if re.fullmatch(deploy_quoting.TIME, value) is None:
        assert_refused(["slurm", "--dryrun", f"--time={value}", "train.py"], "--time .* #SBATCH", capsys)


@pytest.mark.parametrize("argv, message", [
    (["kubernetes", "--dryrun", "--bogus\n---\nkind:Pod", "train.py"], "unrecognized arguments"),
    (["kubernetes", "--dryrun", "--replicas=1\n2", "train.py"], "invalid int value"),
    (["kubernetes", "--dryrun", "--nnodes=1\nx:2", "train.py"], "--nnodes"),
    (["slurm", "--dryrun", "--nproc-per-node=4\nx", "train.py"], "--nproc-per-node"),
    (["kubernetes", "--dryrun", "train.py", "bad\udcffbyte"], "not valid UTF-8"),
    (["slurm", "--dryrun", "--image=\x00", "train.py"], "NUL"),
])
def test_errors_quoting_a_hostile_value_stay_one_line(argv, message, capsys):
    assert_refused(argv, message, capsys)


# ---- slurm: run the script ----------------------------------------------------------------
def make_stubs(bin_dir: Path) -> Path:
    """A PATH folder with stub scontrol and srun; srun writes its argv, NUL-separated."""
    bin_dir.mkdir()
    for name, body in {"scontrol": 'echo node1\n', "srun": 'printf "%s\\0" "$@" > "$SRUN_ARGV"\n'}.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


@pytest.fixture
def slurm_stubs(tmp_path):
    return make_stubs(tmp_path / "bin")


def run_sbatch(text: str, tmp_path: Path, bin_dir: Path) -> list[str]:
    """Run the script as sbatch would (no etcd start: endpoints are rendered); srun's argv."""
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node1",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "4242", "SRUN_ARGV": str(tmp_path / "argv"),
           "ELASTIC_RUN": "/stub/elastic-run", "LC_ALL": "C"}
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path, capture_output=True)
    argv = (tmp_path / "argv").read_bytes().decode("utf-8").split("\0")[:-1]
    assert not (tmp_path / MARKER).exists()
    return argv[argv.index("/stub/elastic-run") + 1:]


def header_argv(text: str, tmp_path: Path) -> list[str]:
    """The `# Rendered by:` line, one line, evaluated by bash."""
    line = next(li for li in text.splitlines() if li.startswith("# Rendered by: "))
    command = line.split("# Rendered by: ", 1)[1]
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {command}"], check=True, cwd=tmp_path,
                          capture_output=True, env={"LC_ALL": "C", "PATH": os.environ["PATH"]})
    assert not (tmp_path / MARKER).exists()
    return done.stdout.decode("utf-8").split("\0")[:-1]


def assert_sbatch_layout(text: str) -> None:
    assert all(c == "\n" or c.isprintable() for c in text)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash" and lines[1].startswith("# Rendered by: ")
    assert lines[2] == "# Re-render with other flags rather than editing by hand."
    assert all(li.startswith("#SBATCH --") and " " not in li[8:] for li in lines[3:lines.index("#")])


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_sbatch_runs_hostile_values_as_one_value(value, capsys, tmp_path, slurm_stubs):
    argv = ["slurm", "--dryrun", f"--rdzv-endpoints=http://e:2379,{value}", *free_flags(value),
            "train.py", value, "--lr", value]
    text = render(argv, capsys)
    assert_sbatch_layout(text)
    agent_argv = run_sbatch(text, tmp_path, slurm_stubs)
    assert_agent_reads(agent_argv, value, "train.py", "4242")
    endpoints = f"http://e:2379,{value}"
    assert flags.build_parser().parse_args(agent_argv).rdzv_endpoints == \
        ",".join(e.strip() for e in endpoints.split(",") if e.strip())
    assert header_argv(text, tmp_path) == ["elastic-run", "deploy", *[a for a in argv if a != "--dryrun"]]


@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_sbatch_entrypoint_and_run_id(value, capsys, tmp_path, slurm_stubs):
    script = f"train{value}.py"
    text = render(["slurm", "--dryrun", "--run-id=nightly", "--rdzv-endpoints=http://e:2379",
                   "--partition=gpu,debug", "--time=2-00:00:00", script, value], capsys)
    assert_sbatch_layout(text)
    assert "#SBATCH --partition=gpu,debug\n#SBATCH --time=2-00:00:00\n" in text
    agent = flags.build_parser().parse_args(run_sbatch(text, tmp_path, slurm_stubs))
    assert (agent.entrypoint, agent.args, agent.run_id) == (script, [value], "nightly")


def usable_log_dir(value: str) -> str:
    """`--log-dir=--` is refused (test_a_swallowed_flag_value_is_refused); any other text is used."""
    return "logs" if value == "--" else value


def usable_image(value: str) -> str:
    """`--image=--` is refused the same way (every `--flag=--` is: cli/flags.py)."""
    return "img" if value == "--" else value


def launcher_script_args(*words: str) -> list[str]:
    """What `elastic-run train.py WORDS...` hands the script (argparse drops a first '--')."""
    return flags.build_parser().parse_args(["train.py", *words]).args


@settings(max_examples=25, deadline=None)
@given(st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12))
def test_sbatch_round_trips_any_text(tmp_path_factory, value):
    tmp_path = tmp_path_factory.mktemp("sbatch")
    bin_dir = make_stubs(tmp_path / "stubs")
    spec, _ = deploy.parse_spec(["slurm", "--dryrun", "--rdzv-endpoints=http://e:2379",
                                 f"--log-dir={usable_log_dir(value)}", "train.py", value, value])
    agent = flags.build_parser().parse_args(run_sbatch(deploy.slurm_script(spec), tmp_path, bin_dir))
    assert (agent.log_dir, agent.args) == (usable_log_dir(value), launcher_script_args(value, value))


@settings(deadline=None)  # machine load, not the code, sets its time
@given(st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))))
@example("--")  # found by hypothesis in a suite run: --image=-- is refused like --log-dir=--
def test_kubernetes_round_trips_any_text(value):
    spec, _ = deploy.parse_spec(["kubernetes", "--dryrun", f"--image={usable_image(value)}",
                                 f"--log-dir={usable_log_dir(value)}", "train.py", value, value])
    docs = k8s_documents(deploy.kubernetes_stream(spec))
    assert len(docs) == 5
    pod = docs[-1]["spec"]["template"]["spec"]["containers"][0]
    agent = flags.build_parser().parse_args([kube_expand(a, K8S_ENV) for a in pod["args"]])
    assert (pod["image"] or "elastic-runner:cpu", agent.log_dir, agent.args) == \
        (usable_image(value) or "elastic-runner:cpu", usable_log_dir(value),
         launcher_script_args(value, value))


@pytest.mark.parametrize("words", [["--"], ["--", "x"], ["--", "--"], ["--", "--", "x"],
                                   ["a", "--", "b"], ["--", "--lr", "1"]])
@pytest.mark.parametrize("kind", ["slurm", "kubernetes"])
def test_a_double_dash_reaches_the_script_as_the_launcher_would_pass_it(kind, words, tmp_path,
                                                                        slurm_stubs):
    """deploy renders `train.py -- -- x` so that the agent's argparse leaves the script
    `-- x`, as `elastic-run train.py -- -- x` would; before, it got `x`."""
    spec, _ = deploy.parse_spec([kind, "--dryrun", "--rdzv-endpoints=http://e:2379", "train.py",
                                 *words])
    if kind == "slurm":
        argv = run_sbatch(deploy.slurm_script(spec), tmp_path, slurm_stubs)
    else:
        pod = k8s_documents(deploy.kubernetes_stream(spec))[-1]["spec"]["template"]["spec"]
        argv = [kube_expand(a, K8S_ENV) for a in pod["containers"][0]["args"]]
    assert flags.build_parser().parse_args(argv).args == launcher_script_args(*words)


@pytest.mark.parametrize("verb_argv, flag", [
    (["deploy", "slurm", "--dryrun", "--rdzv-endpoints=http://e:2379", "--log-dir=--", "train.py"],
     "--log-dir"),
    (["deploy", "kubernetes", "--dryrun", "--name=--", "train.py"], "--name"),
    (["status", "--run-id=--"], "--run-id"),
    (["notice", "--rdzv-endpoints=http://e:2379", "--run-id=r", "--node-id=--"], "--node-id"),
    (["report", "logs", "--output=--"], "--output"),
    (["report", "logs", "-o--"], "-o"),
])
def test_a_swallowed_flag_value_is_refused_by_every_verb(verb_argv, flag, capsys):
    """Python 3.11's argparse parses `--flag=--` to [] without calling the flag's type."""
    assert cli.main(verb_argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"error: {flag} got '--'" in err


# ---- quoting primitives ---------------------------------------------------------------------
@pytest.mark.parametrize("value", HOSTILE, ids=IDS)
def test_shell_quote_is_one_line_and_round_trips(value, tmp_path):
    word = deploy_quoting.shell_quote(value)
    assert word.isprintable()
    if value.isprintable():
        assert word == shlex.quote(value)
    done = subprocess.run(["bash", "-c", f"printf '%s' {word}"], check=True, cwd=tmp_path,
                          capture_output=True, env={"LC_ALL": "C"})
    assert done.stdout.decode("utf-8") == value
    assert not (tmp_path / MARKER).exists()


def test_deploy_imports_no_grpc_or_etcd_client_of_its_own():
    """deploy's own imports: stdlib, yaml and torch/grpc-free project modules (cli is the verb's host)."""
    import ast
    allowed = {"argparse", "math", "re", "shlex", "string", "importlib", "dataclasses", "pathlib",
               "typing", "yaml",
               "__future__", "elastic_runner.cli.flags", "elastic_runner.cli.deploy_quoting",
               "elastic_runner.errors", "elastic_runner.ids", "elastic_runner.rendezvous.protocol"}
    for module in (deploy, deploy_quoting):
        tree = ast.parse(Path(module.__file__).read_text())
        names = {n.module if isinstance(n, ast.ImportFrom) else a.name
                 for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in (n.names if isinstance(n, ast.Import) else [None])}
        assert names <= allowed, names - allowed
