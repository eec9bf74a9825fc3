"""Which GPUs a node's workers use, from `nvidia-smi -L` and CUDA_VISIBLE_DEVICES
(cli/gpus.py). The listing below has the driver tool's line format; no GPU is
needed to read it."""

from __future__ import annotations

import logging
import subprocess

import pytest

from elastic_runner.cli.gpus import parse_listing, used_gpus, visible_gpus
from elastic_runner.cli.run import build_config
from elastic_runner.cli.flags import build_parser

G0 = "GPU-6d0f3e1c-6e5e-1f41-6a2c-1b0c3d2e4f50"
G1 = "GPU-7a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
G2 = "GPU-7a1b9999-0000-1111-2222-333344445555"
M0 = "MIG-1c2d3e4f-5a6b-5c7d-8e9f-0a1b2c3d4e5f"
LISTING = f"""GPU 0: NVIDIA H100 80GB HBM3 (UUID: {G0})
GPU 1: NVIDIA H100 80GB HBM3 (UUID: {G1})
  MIG 3g.40gb     Device  0: (UUID: {M0})
GPU 2: NVIDIA H100 80GB HBM3 (UUID: {G2})
No devices were found on a line we do not know
"""


def test_the_listing_gives_every_gpu_by_index_and_every_mig_instance():
    gpus, migs = parse_listing(LISTING)
    assert gpus == {0: G0, 1: G1, 2: G2}
    assert migs == [M0]


@pytest.mark.parametrize("setting, expected", [
    (None, [G0, G1, G2]),                 # unset: every GPU, in index order
    ("", []),                             # set empty: CUDA shows none
    ("2,0", [G2, G0]),
    (" 1 , 2 ", [G1, G2]),
    ("0,7,1", [G0]),                      # CUDA stops at the first it cannot resolve
    ("GPU-6d0f", [G0]),                   # a unique prefix of a UUID
    ("GPU-7a1b,0", []),                   # an ambiguous prefix resolves nothing
    (M0, [M0]),
    ("0,0,1", [G0, G1]),
    ("../../x,0", []),
    ("0\n1", []),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(setting, expected):
    gpus, migs = parse_listing(LISTING)
    assert visible_gpus(setting, gpus, migs) == expected


def test_a_node_of_n_workers_uses_the_first_n_visible_gpus():
    listing = lambda arguments: LISTING  # noqa: E731
    assert used_gpus({}, 2, run=listing) == (G0, G1)
    assert used_gpus({"CUDA_VISIBLE_DEVICES": "2,1"}, 1, run=listing) == (G2,)
    assert used_gpus({}, 8, run=listing) == (G0, G1, G2)


def test_a_machine_without_the_driver_tool_claims_nothing(tmp_path):
    assert used_gpus({"PATH": str(tmp_path)}, 4) == ()


def test_a_failing_driver_tool_claims_nothing_and_says_so(caplog):
    def broken(arguments):
        raise subprocess.CalledProcessError(9, ["nvidia-smi", *arguments])
    with caplog.at_level(logging.WARNING):
        assert used_gpus({}, 2, run=broken) == ()
    assert "a second agent on this machine is not caught" in caplog.text


def test_the_cli_puts_the_gpus_found_on_path_into_the_rendezvous_config(tmp_path):
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] && printf '%s\\n' '{LISTING.splitlines()[0]}'"
                    f" '{LISTING.splitlines()[1]}'\n")
    tool.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["--standalone", "--nproc-per-node", "2", str(script)])
    config = build_config(args, {"PATH": str(tmp_path)}, 0)
    assert config.rendezvous.devices == (G0, G1)
    config = build_config(args, {"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "1"}, 0)
    assert config.rendezvous.devices == (G1,)
