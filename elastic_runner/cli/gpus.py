"""Which physical GPUs this node's workers will use, by the driver's UUIDs.

Why: the default node id is the host name and the agent's pid, so the same command
started twice on one machine (a second terminal, a service and a hand start) is two
nodes of one run, and both put local rank 0 on GPU 0. NCCL refuses a communicator
with two ranks on one GPU ("Duplicate GPU detected"), so the second agent's join
ends the *running* job in a crash loop. The agent claims its GPUs in etcd before it
announces itself (rendezvous/devices.py); this module says which they are.

A GPU's UUID is the same in every container and namespace that sees it, where an
index or a host name is not. The driver's tool lists them (`nvidia-smi -L`, in its
index order, which is PCI bus order). CUDA_VISIBLE_DEVICES entries are read as CUDA
reads them: an index, or a UUID or a unique prefix of one; CUDA ignores every entry
from the first it cannot resolve on, and so does this. Workers bind cuda:LOCAL_RANK
among the visible GPUs (worker/runtime.py), so a node of N workers uses the first N.

Assumed, not verified here (no GPU on the machines this was written on): CUDA's
default order (fastest first) equals PCI order on machines whose GPUs are all one
model; on a mixed machine integer CUDA_VISIBLE_DEVICES entries are read in PCI order
(set CUDA_DEVICE_ORDER=PCI_BUS_ID to make CUDA agree).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from typing import Callable, Mapping

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 10.0
# `GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-6d0f3e1c-...)` and, below a GPU in MIG
# mode, `  MIG 3g.40gb     Device  0: (UUID: MIG-...)`.
_GPU_LINE = re.compile(r"GPU (\d+): .*\(UUID: (GPU-[0-9A-Za-z-]{1,80})\)\s*$")
_MIG_LINE = re.compile(r"\s+MIG .*\(UUID: (MIG-[0-9A-Za-z-]{1,80})\)\s*$")

Runner = Callable[[list[str]], str]


def used_gpus(environ: Mapping[str, str], nproc: int, run: Runner | None = None
              ) -> tuple[str, ...]:
    """The UUIDs of the GPUs this node's `nproc` workers bind; () on a machine without
    NVIDIA's driver tool (every CPU machine) or where it fails."""
    if run is None:
        tool = shutil.which("nvidia-smi", path=environ.get("PATH"))
        if tool is None:
            return ()
        run = _runner(tool)
    try:
        listing = run(["-L"])
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi -L failed (%s): this node's GPUs are not claimed, so a "
                    "second agent on this machine is not caught", exc)
        return ()
    gpus, migs = parse_listing(listing)
    visible = visible_gpus(environ.get("CUDA_VISIBLE_DEVICES"), gpus, migs)
    return tuple(visible[:max(nproc, 0)])


def _runner(tool: str) -> Runner:
    def run(arguments: list[str]) -> str:
        done = subprocess.run([tool, *arguments], capture_output=True, text=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S, check=True)
        return done.stdout
    return run


def parse_listing(text: str) -> tuple[dict[int, str], list[str]]:
    """`nvidia-smi -L` as (index -> GPU UUID, every MIG UUID); lines it does not
    recognise are skipped."""
    gpus: dict[int, str] = {}
    migs: list[str] = []
    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            gpus[int(gpu.group(1))] = gpu.group(2)
            continue
        mig = _MIG_LINE.match(line)
        if mig:
            migs.append(mig.group(1))
    return gpus, migs


def visible_gpus(setting: str | None, gpus: dict[int, str], migs: list[str]) -> list[str]:
    """The UUIDs CUDA shows a process under CUDA_VISIBLE_DEVICES=`setting`, in order."""
    if setting is None:
        return [gpus[index] for index in sorted(gpus)]
    known = list(gpus.values()) + migs
    visible: list[str] = []
    for entry in (part.strip() for part in setting.split(",")):
        uuid = _resolve(entry, gpus, known)
        if uuid is None:
            break  # CUDA stops at the first entry it cannot resolve
        if uuid not in visible:
            visible.append(uuid)
    return visible


def _resolve(entry: str, gpus: dict[int, str], known: list[str]) -> str | None:
    if entry.isdigit():
        return gpus.get(int(entry))
    if entry.startswith(("GPU-", "MIG-")):
        matches = [uuid for uuid in known if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None
