"""No tracked file names a path of the machine it was written on: a published result
that records `/tmp/trial.json` or a checkout's absolute path tells a reader nothing and
breaks on the next machine. Benchmarks write paths relative to the repository
(bench/common.py: result_text)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Home, temp and workspace folders, each at the start of an absolute path (not the
# tail of a URL or of a relative path such as `deploy/tmp/`).
MACHINE_PATH = re.compile(r"(?<![\w.$~/-])/(?:home|root|Users|work|tmp|var/folders)/[\w.-]+")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    files = []
    for name in filter(None, names):
        path = ROOT / name
        if path.is_file() and path.stat().st_size < 5_000_000:
            files.append(path)
    return files


def machine_paths(text: str, root: str) -> list[str]:
    found = MACHINE_PATH.findall(text)
    return found + ([root] if root in text else [])


def test_no_tracked_file_names_a_machine_path():
    offenders = {}
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # images and other binaries
        found = machine_paths(text, str(ROOT))
        if found and path != Path(__file__).resolve():
            offenders[str(path.relative_to(ROOT))] = sorted(set(found))[:3]
    assert not offenders, f"tracked files that name a path of a machine: {offenders}"


def test_the_pattern_tells_machine_paths_from_others():
    assert machine_paths('"out": "/tmp/k10-3.json"', "/srv/repo") == ["/tmp/k10-3.json"]
    assert machine_paths("trace /home/alice/repo/bench/x.csv", "/srv/repo") == ["/home/alice"]
    assert machine_paths("see /srv/repo/bench/README.md", "/srv/repo") == ["/srv/repo"]
    assert machine_paths("https://example.com/home/page and deploy/tmp/x", "/srv/repo") == []
