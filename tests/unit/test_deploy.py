"""`elastic-run deploy`: golden renders, Kubernetes schema validation, recipe drift.

Golden files live in tests/golden/. After an intended change to the renderer,
regenerate them (and the rendered recipes under deploy/) with

    ELASTIC_RUN_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_deploy.py

and review the diff. Schemas come from the `kubernetes-validate` package (the
Kubernetes OpenAPI definitions as JSON Schema, strict variant: unknown fields
fail). The OpenAPI schema leaves a container's `image` optional (the API server
demands it for workloads), so `check_object` adds that rule on top.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from elastic_runner.cli import deploy, main as cli
from elastic_runner.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
RECIPES = ROOT / "deploy"
K8S_VERSION = "1.30"
REGEN = os.environ.get("ELASTIC_RUN_REGEN_GOLDEN") == "1"

CASES = {
    "kubernetes-gpu.yaml": "kubernetes --dryrun --min-nodes 2 --max-nodes 4 --nproc-per-node 8 "
                           "--gpus-per-node 8 --run-id job7 --image reg.example/train:1 "
                           "train.py --lr 0.1",
    "kubernetes-external-etcd.yaml": "kubernetes --dryrun --nnodes 1:3 --namespace ml --cpus 2 "
                                     "--memory 4Gi --rdzv-endpoints http://etcd-a:2379,http://etcd-b:2379 "
                                     "--notice-deadline 60 --max-restarts 5 -v -m mypkg.train --epochs yes",
    "kubernetes-proxy.yaml": "kubernetes --dryrun --min-nodes 64 --max-nodes 512 "
                             "--nproc-per-node 8 --gpus-per-node 8 --grpc-proxies 3 --run-id big "
                             "--image reg.example/train:1 train.py",
    "slurm-gpu.sbatch": "slurm --dryrun --min-nodes 2 --max-nodes 4 --nproc-per-node 8 "
                        "--gpus-per-node 8 --partition gpu --time 24:00:00 train.py --lr '0.1 x'",
    "slurm-cpu.sbatch": "slurm --dryrun --min-nodes 1 --max-nodes 2 --run-id nightly "
                        "--rdzv-endpoints http://etcd:2379 --notice-deadline 90 train.py",
    # Hostile values (issue 12): each must stay one inert value; see test_deploy_hostile.py.
    "kubernetes-hostile.yaml": "kubernetes --dryrun --run-id job7 --image 'reg.example/t:1' "
                               "--log-dir 'a\nb: c' train.py 'x\n---\napiVersion: v1\nkind: Pod' "
                               "'$(POD_IP)' '`touch PWNED`' \"it's # {here}\"",
    "slurm-hostile.sbatch": "slurm --dryrun --run-id nightly --partition gpu --time 1:00:00 "
                            "--log-dir 'a\ntouch PWNED' train.py 'x\ntouch PWNED' '$(touch PWNED)' "
                            "'`id`' \"it's # \\\"q\\\"\"",
}
HOSTILE_ARGS = {"kubernetes-hostile.yaml": ["x\n---\napiVersion: v1\nkind: Pod", "$(POD_IP)",
                                            "`touch PWNED`", "it's # {here}"],
                "slurm-hostile.sbatch": ["x\ntouch PWNED", "$(touch PWNED)", "`id`", 'it\'s # "q"']}


def render(args: str, capsys) -> str:
    assert deploy.main(shlex.split(args), {}) == 0
    return capsys.readouterr().out


def rerender_recipe(path: Path) -> dict[str, str]:
    """Render again from the command recorded in the file's header."""
    command = path.read_text().splitlines()[1 if path.suffix == ".sbatch" else 0]
    argv = shlex.split(command.split("Rendered by: ", 1)[1])[2:]
    spec, _ = deploy.parse_spec([*argv[:1], "--dryrun", *argv[1:]])
    return deploy.render(spec)


# ---- validation helpers --------------------------------------------------------------
def check_object(obj: dict[str, Any]) -> None:
    """Kubernetes schema (strict) plus the rules the schema leaves to the API server."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    pod = obj.get("spec", {}).get("template", {}).get("spec")
    if pod is not None:
        for container in pod["containers"]:
            assert container.get("image"), f"{obj['kind']}: container {container['name']} has no image"


def objects_of(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def deployment_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == "Deployment")


# ---- golden ---------------------------------------------------------------------------
@pytest.mark.parametrize("golden", sorted(CASES))
def test_render_matches_golden(golden, capsys):
    text = render(CASES[golden], capsys)
    path = GOLDEN / golden
    if REGEN:
        path.write_text(text)
    assert text == path.read_text(), f"re-render differs from {path}; see the module docstring"


@pytest.mark.parametrize("path", sorted([*RECIPES.glob("kubernetes/base/*.yaml"),
                                         *RECIPES.glob("slurm/*.sbatch")]), ids=lambda p: p.name)
def test_shipped_recipes_are_current_renders(path):
    files = rerender_recipe(path)
    if REGEN:
        path.write_text(files[path.name])
    assert files[path.name] == path.read_text(), f"{path} is stale: re-run its header command"


# ---- kubernetes schema ----------------------------------------------------------------
@pytest.mark.parametrize("golden", [g for g in sorted(CASES) if g.endswith(".yaml")])
def test_rendered_objects_pass_the_kubernetes_schema(golden, capsys):
    objects = objects_of(render(CASES[golden], capsys))
    assert objects
    for obj in objects:
        check_object(obj)


@pytest.mark.parametrize("golden", sorted(HOSTILE_ARGS))
def test_hostile_golden_values_read_back(golden, capsys):
    argv = shlex.split(CASES[golden])
    assert argv[-4:] == HOSTILE_ARGS[golden]
    text = render(CASES[golden], capsys)
    assert text.count("\n---\n") == (5 if golden.endswith(".yaml") else 0)
    if golden.endswith(".yaml"):
        args = deployment_of(objects_of(text))["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[-7:] == ["--log-dir", "a\nb: c", "train.py",
                             *(a.replace("$", "$$") for a in HOSTILE_ARGS[golden])]
    else:  # the script itself is run with stubs in test_deploy_hostile.py
        assert "\n    train.py $'x\\ntouch PWNED' '$(touch PWNED)' '`id`' " in text
        assert "\ntouch PWNED" not in text


def test_yaml_round_trips_through_pyyaml(capsys):
    spec, _ = deploy.parse_spec(shlex.split(CASES["kubernetes-gpu.yaml"]))
    expected = deploy.etcd_objects(spec) + [deploy.train_deployment(spec)]
    assert objects_of(deploy.kubernetes_stream(spec)) == expected


def test_long_values_stay_on_one_line(capsys):
    """PyYAML folds long scalars at 80 columns by default; the renderer does not."""
    value = "x " * 150
    text = render(f"kubernetes --dryrun train.py '{value}'", capsys)
    assert any(line.endswith(f"- '{value}'") for line in text.splitlines())
    assert deployment_of(objects_of(text))["spec"]["template"]["spec"]["containers"][0]["args"][-1] == value


def test_slurm_template_ships_as_package_data_and_every_placeholder_is_filled():
    template = deploy.SlurmTemplate(deploy.slurm_template())
    assert set(template.get_identifiers()) == {"header", "directives", "run_id", "endpoints",
                                               "command", "grace"}
    assert "$" in template.template  # bash's own `$` stays as written
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]
    assert "templates/*" in package_data["elastic_runner.cli"]


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d["spec"].__setitem__("replicas", "three"), "is not of type"),
    (lambda d: d["spec"]["template"]["spec"].__setitem__("terminationGracePeriod", 45),
     "Additional properties"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "'name' is a required"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("image"), "has no image"),
])
def test_validator_rejects_broken_manifests(breakage, message, capsys):
    deployment = deployment_of(objects_of(render(CASES["kubernetes-gpu.yaml"], capsys)))
    check_object(deployment)
    breakage(deployment)
    with pytest.raises((kubernetes_validate.ValidationError, AssertionError), match=message):
        check_object(deployment)


# ---- kustomize layout -----------------------------------------------------------------
def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def strategic_merge(base: Any, patch: Any) -> Any:
    """Enough of kustomize's strategic merge for our patches: lists merge by name/mountPath."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(i, dict) for i in base + patch):
        key = next((k for k in ("name", "mountPath") if all(k in i for i in base + patch)), None)
        if key:
            merged = {item[key]: item for item in base}
            for item in patch:
                merged[item[key]] = strategic_merge(merged[item[key]], item) if item[key] in merged else item
            return list(merged.values())
    return patch


def build_overlay(directory: Path) -> list[dict[str, Any]]:
    """A small stand-in for `kustomize build` (no kustomize binary here)."""
    spec = kustomization(directory)
    objects: list[dict[str, Any]] = []
    for resource in spec["resources"]:
        target = directory / resource
        objects += build_overlay(target) if target.is_dir() else objects_of(target.read_text())
    for entry in spec.get("patches", []):
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        objects = [strategic_merge(o, patch) if (o["kind"], o["metadata"]["name"]) ==
                   (patch["kind"], patch["metadata"]["name"]) else o for o in objects]
    for image in spec.get("images", []):
        for obj in objects:
            for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for replicas in spec.get("replicas", []):
        for obj in objects:
            if obj["metadata"]["name"] == replicas["name"] and obj["kind"] == "Deployment":
                obj["spec"]["replicas"] = replicas["count"]
    return objects


KUSTOMIZE_DIRS = sorted(p.parent for p in RECIPES.glob("kubernetes/**/kustomization.yaml"))


@pytest.mark.parametrize("directory", KUSTOMIZE_DIRS, ids=lambda p: p.name)
def test_kustomizations_reference_existing_files(directory):
    spec = kustomization(directory)
    paths = [*spec["resources"], *(p["path"] for p in spec.get("patches", []))]
    for path in paths:
        target = directory / path
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{directory}: {path}"


@pytest.mark.parametrize("overlay, gpus, nproc", [("cpu-test", None, "1"), ("gpu", 8, "8")])
def test_overlays_build_to_valid_objects(overlay, gpus, nproc):
    objects = build_overlay(RECIPES / "kubernetes" / "overlays" / overlay)
    for obj in objects:
        check_object(obj)
    container = deployment_of(objects)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NPROC_PER_NODE"] == nproc and env["POD_NAME"] is None
    assert container["resources"].get("limits", {}).get("nvidia.com/gpu") == gpus
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/checkpoints"}


def test_statefulset_is_a_three_member_etcd_cluster():
    objects = objects_of((RECIPES / "kubernetes" / "base" / "etcd.yaml").read_text())
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert sts["spec"]["replicas"] == 3 and cluster.count("=http://etcd-") == 3
    assert next(o for o in objects if o["kind"] == "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    train = deployment_of(objects_of((RECIPES / "kubernetes" / "base" / "train.yaml").read_text()))
    launcher = train["spec"]["template"]["spec"]["containers"][0]["args"]
    endpoints = launcher[launcher.index("--rdzv-endpoints") + 1].split(",")
    assert endpoints == [f"http://etcd-{i}.etcd:2379" for i in range(3)]


# ---- grace period, slurm, errors ---------------------------------------------------------
@pytest.mark.parametrize("deadline", [0, 25, 44.5, 120])
def test_grace_period_outlasts_the_notice(deadline, capsys):
    text = render(f"kubernetes --dryrun --notice-deadline {deadline} train.py", capsys)
    grace = deployment_of(objects_of(text))["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > deadline + 5  # 5: --stop-grace default
    script = render(f"slurm --dryrun --notice-deadline {deadline} train.py", capsys)
    lead = int(script.split("--signal=B:TERM@", 1)[1].split()[0])
    assert lead >= grace and lead >= 60


@pytest.mark.parametrize("golden", [g for g in sorted(CASES) if g.endswith(".sbatch")])
def test_slurm_script_is_valid_bash(golden, capsys, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render(CASES[golden], capsys))
    subprocess.run(["bash", "-n", str(script)], check=True)
    for required in ("#SBATCH --requeue", "#SBATCH --signal=B:TERM@", "srun --kill-on-bad-exit=0"):
        assert required in script.read_text()


def test_output_writes_files_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "out"
    assert deploy.main(["kubernetes", "--output", str(out), "train.py"], {}) == 0
    assert sorted(p.name for p in out.iterdir()) == ["etcd.yaml", "kustomization.yaml", "train.yaml"]
    assert kustomization(out)["resources"] == ["etcd.yaml", "train.yaml"]


@pytest.mark.parametrize("args, message", [
    ("kubernetes train.py", "--output DIR"),
    ("openshift --dryrun train.py", "kubernetes|slurm"),
    ("kubernetes --dryrun --node-id a train.py", "--node-id is set per node"),
    ("kubernetes --dryrun --standalone train.py", "--standalone is set per node"),
    ("kubernetes --dryrun --min-nodes 3 --max-nodes 2 train.py", "greater than --max-nodes"),
    ("kubernetes --dryrun --nproc-per-node 4 --gpus-per-node 2 train.py", "its own GPU"),
    ("kubernetes --dryrun --nproc-per-node zero train.py", "positive integer"),
    ("kubernetes --dryrun --replicas x train.py", "invalid int value"),
    ("kubernetes --dryrun --bogus train.py", "unrecognized arguments: --bogus"),
    ("kubernetes --dryrun --time 1:00:00 train.py", "for slurm only"),
    ("slurm --dryrun --image x train.py", "for kubernetes only"),
    ("slurm --dryrun --min-nodes 2 --replicas 1 train.py", "cannot grow"),
    ("slurm --dryrun --grpc-proxies 2 train.py", "--grpc-proxies is for kubernetes only"),
    ("kubernetes --dryrun --grpc-proxies -1 train.py", "need 0 or more"),
    ("kubernetes --dryrun --grpc-proxies 2 --rdzv-endpoints https://etcd:2379 train.py",
     "TLS etcd is not rendered"),
    ("slurm --dryrun", "required: entrypoint"),
])
def test_bad_flags_are_one_line_config_errors(args, message, capsys):
    with pytest.raises(ConfigError, match=message) as raised:
        deploy.main(shlex.split(args), {})
    assert "\n" not in str(raised.value)
    assert cli.main(["deploy", *shlex.split(args)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_grpc_proxies_sit_between_the_nodes_and_etcd(tmp_path, capsys):
    """README "Deploying": the nodes reach etcd through the proxies' Service only, and the
    proxies reach the etcd this render uses (its own members, or --rdzv-endpoints)."""
    objects = objects_of(render("kubernetes --dryrun --grpc-proxies 2 train.py", capsys))
    proxy, train = [o for o in objects if o["kind"] == "Deployment"]
    assert proxy["metadata"]["name"] == "etcd-proxy" and proxy["spec"]["replicas"] == 2
    args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["grpc-proxy", "start"]
    assert "--endpoints=etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379" in args
    launcher = train["spec"]["template"]["spec"]["containers"][0]["args"]
    assert launcher[launcher.index("--rdzv-endpoints") + 1] == "http://etcd-proxy:23790"
    assert {"Service", "StatefulSet"} <= {o["kind"] for o in objects}
    external = objects_of(render("kubernetes --dryrun --grpc-proxies 1 --rdzv-endpoints "
                                 "http://etcd-a:2379,http://etcd-b:2379 train.py", capsys))
    assert "StatefulSet" not in {o["kind"] for o in external}  # their etcd, not ours
    proxy_args = deployment_of(external)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--endpoints=etcd-a:2379,etcd-b:2379" in proxy_args
    out = tmp_path / "out"
    assert deploy.main(["kubernetes", "--output", str(out), "--grpc-proxies", "2", "train.py"],
                       {}) == 0
    assert kustomization(out)["resources"] == ["etcd.yaml", "etcd-proxy.yaml", "train.yaml"]


def test_environment_does_not_change_the_render(capsys):
    plain = render("kubernetes --dryrun train.py", capsys)
    assert deploy.main(["kubernetes", "--dryrun", "train.py"], {"ELASTIC_RUN_MIN_NODES": "3"}) == 0
    assert capsys.readouterr().out == plain
