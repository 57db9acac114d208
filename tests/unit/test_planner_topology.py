"""``ptdp plan --topology FILE``: a node's real GPU count and link types replace the catalog's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.planner.candidate import Candidate
from ptdp.planner.inputs.hardware import CATALOG, GB, Cluster
from ptdp.planner.inputs.models import get_model
from ptdp.planner.inputs.node_links import PCIE_BANDWIDTH, gpu_for_topology
from ptdp.planner.time.step_time import evaluate_performance
from ptdp.topology.nvsmi import parse_nvidia_smi_topo

TOPO = Path(__file__).parents[1] / "data" / "topo"


def _topology(name: str):
    path = TOPO / name
    return parse_nvidia_smi_topo(path.read_text(), source=str(path))


@pytest.mark.parametrize(
    "name, gpus, bandwidth",
    [
        ("hgx_a100_8gpu_nvswitch.txt", 8, 300 * GB),  # NV12 everywhere: the catalog's 300 GB/s stays
        ("nvlink_4gpu_nv4_4nic.txt", 4, 300 * GB),  # 3 peers x 4 links x 25 GB/s
        ("pcie_8x4090_no_nvlink.txt", 8, PCIE_BANDWIDTH),
    ],
)
def test_gpu_adapted_to_saved_topologies(name, gpus, bandwidth):
    gpu, notes = gpu_for_topology(CATALOG["a100-80gb"], _topology(name))
    assert gpu.gpus_per_node == gpus
    assert gpu.nvlink_bandwidth == pytest.approx(bandwidth)
    assert gpu.peak_flops == CATALOG["a100-80gb"].peak_flops
    assert any(f"{gpus} GPUs per node" in n for n in notes)


def test_fewer_nvlinks_than_the_catalog_lower_the_bandwidth():
    text = "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNV2\t0-7\t0\nGPU1\tNV2\t X \t0-7\t0\n"
    gpu, _ = gpu_for_topology(CATALOG["a100-80gb"], parse_nvidia_smi_topo(text))
    assert gpu.nvlink_bandwidth == pytest.approx(50 * GB) and gpu.gpus_per_node == 2


def test_pcie_node_makes_tensor_parallelism_slower():
    model, layout = get_model("gpt-1.7b"), Candidate.of(8, 1, 2, 1, 64, precision="bf16")
    times = {}
    for name in ("hgx_a100_8gpu_nvswitch.txt", "pcie_8x4090_no_nvlink.txt"):
        gpu, _ = gpu_for_topology(CATALOG["a100-80gb"], _topology(name))
        times[name] = evaluate_performance(model, layout, Cluster(gpu, 16, gpu.gpus_per_node)).time
    nv, pcie = times["hgx_a100_8gpu_nvswitch.txt"], times["pcie_8x4090_no_nvlink.txt"]
    assert pcie.tp_comm > 5 * nv.tp_comm and pcie.compute == pytest.approx(nv.compute)


def test_plan_command_with_topology(capsys):
    base = ["plan", "--model", "gpt-1.7b", "--gpus", "16", "--global-batch-size", "64", "--top", "3"]
    assert main(base + ["--topology", str(TOPO / "nvlink_4gpu_nv4_4nic.txt"), "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert all(p["tp"] <= 4 for p in plans if p["fits"])
    wide = [p for p in plans if p["tp"] == 8]
    assert wide and all("tp=8 crosses nodes (4 GPUs per node)" in " ".join(p["reasons"]) for p in wide)
    assert main(base + ["--topology", str(TOPO / "pcie_8x4090_no_nvlink.txt")]) == 0
    assert "modelled at PCIe bandwidth" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--topology", "/nonexistent/topo.txt"], "--topology /nonexistent/topo.txt: No such file"),
        (["--gpus-per-node", "8", "--topology", str(TOPO / "nvlink_4gpu_nv4_4nic.txt")], "contradicts --topology"),
    ],
)
def test_plan_topology_errors(extra, message, capsys, tmp_path):
    code = main(["plan", "--model", "gpt-1.7b", "--gpus", "16", "--global-batch-size", "64"] + extra)
    assert code != 0 and message in capsys.readouterr().err


def test_plan_topology_that_does_not_parse(capsys, tmp_path):
    bad = tmp_path / "topo.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tNVX\nGPU1\tNVX\t X \n")
    assert (
        main(["plan", "--model", "gpt-1.7b", "--gpus", "16", "--global-batch-size", "64", "--topology", str(bad)]) != 0
    )
    err = capsys.readouterr().err
    assert "--topology" in err and "line 2" in err and "NVX" in err
