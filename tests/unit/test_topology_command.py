"""``ptdp topo``: text and JSON output for saved ``nvidia-smi topo -m`` files and this machine, default
sizes, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.cli import main

DATA = Path(__file__).parents[1] / "data" / "topo"
HGX = str(DATA / "hgx_a100_8gpu_nvswitch.txt")
PCIE = str(DATA / "pcie_8x4090_no_nvlink.txt")


def run_json(capsys, *flags: str) -> dict:
    assert main(["topo", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_of_a_saved_file_with_placement(capsys):
    out = run_json(capsys, "--file", HGX, "--tp", "2", "--pp", "2")
    assert set(out) == {"source", "gpus", "links", "nics", "numa_nodes", "cpus", "placement"}
    assert [g["numa_node"] for g in out["gpus"]] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert out["gpus"][4] == {"index": 4, "numa_node": 7, "cpus": list(range(112, 128))}
    assert out["links"][0] == ["X"] + ["NV12"] * 7 and len(out["links"]) == 8
    assert out["nics"] == [
        {"name": "mlx5_0", "device": None, "links": ["SYS", "SYS", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS"]}
    ]
    assert out["numa_nodes"] == {
        "1": list(range(16, 32)),
        "3": list(range(48, 64)),
        "5": list(range(80, 96)),
        "7": list(range(112, 128)),
    }
    p = out["placement"]
    assert (p["tp"], p["pp"], p["dp"], p["nproc_per_node"], p["num_nodes"]) == (2, 2, 2, 8, 1)  # dp fills the node
    assert p["gpu_of_local_rank"] == list(range(8)) and p["numa_of_local_rank"] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert p["tp_groups"][1] == {
        "local_ranks": [2, 3],
        "gpus": [2, 3],
        "numa_nodes": [1],
        "worst_link": "NV12",
        "crosses_nodes": False,
    }
    assert p["tp_link_kind"] == "NVLink" and p["warnings"] == []


def test_json_without_sizes_has_no_placement_and_null_numa(capsys, tmp_path):
    topo = tmp_path / "topo.txt"
    topo.write_text("\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-7\t\tN/A\t\tN/A\n")
    out = run_json(capsys, "--file", str(topo))
    assert out["placement"] is None and out["gpus"] == [{"index": 0, "numa_node": None, "cpus": list(range(8))}]
    assert out["links"] == [["X"]] and out["nics"] == [] and out["numa_nodes"] == {}


def test_text_output_shows_matrix_placement_and_warnings(capsys):
    assert main(["topo", "--file", PCIE, "--tp", "4"]) == 0
    text = capsys.readouterr().out
    assert "8 GPUs, 2 NICs, 2 NUMA nodes, 224 CPUs known" in text
    assert "GPU6  SYS   SYS   SYS   SYS   SYS   SYS   X     SYS   PHB   PHB   1     56-111,168-223" in text
    assert "placement: tp=4 pp=1 dp=2 on 1 node of 8 processes" in text
    assert "local ranks [4, 5, 6, 7]: GPUs 4, 5, 6, 7, NUMA 1, worst link SYS" in text
    assert "warning: no NVLink on this node (PCIe only): tp=4 groups communicate over PCIe (worst link SYS)" in text


def test_this_machine(capsys):
    out = run_json(capsys, "--tp", "1", "--dp", "2", "--nproc-per-node", "2")
    assert out["source"] and out["cpus"] and out["placement"]["nproc_per_node"] == 2
    assert len(out["placement"]["numa_of_local_rank"]) == 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--file", HGX, "--tp", "3"], "give --dp: tp*pp = 3*1 = 3 does not divide the 8 GPUs of one node"),
        (["--file", HGX, "--tp", "0"], "--tp=0 must be a positive integer"),
        (["--file", HGX, "--nproc-per-node", "9"], "9 processes per node but the node has only 8 GPUs"),
        (["--file", HGX, "--tp", "2", "--dp", "3"], "world size tp*pp*dp = 2*1*3 = 6 is not a multiple of the 8"),
        (["--file", "/nonexistent/topo.txt"], "--file /nonexistent/topo.txt: No such file or directory"),
        (["--file", __file__], "no header line found"),
    ],
)
def test_errors_are_one_line_with_exit_status_2(flags, message, capsys):
    assert main(["topo", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("ptdp topo: error: ") and message in captured.err
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_parse_error_names_the_line_and_debug_shows_the_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text(Path(HGX).read_text().replace("PXB     16-31   1", "PXB     16-31   one", 1))
    assert main(["topo", "--file", str(bad)]) == 2
    assert f'{bad}: line 6: NUMA Affinity "one" is not a NUMA node number' in capsys.readouterr().err
    assert main(["topo", "--file", str(bad), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err
