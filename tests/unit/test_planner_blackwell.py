"""Blackwell GPUs in the planner: the catalog's datasheet figures and NVL72 racks (a 72-GPU NVLink
domain of 4-GPU hosts), and the per-architecture MoE constants."""

from __future__ import annotations

import pytest

from ptdp import cli
from ptdp.api import plan
from ptdp.planner.inputs.hardware import CATALOG, GB, TFLOPS, Cluster, load_catalog
from ptdp.planner.time.constants import PerfConstants

MiB = 2**20


@pytest.mark.parametrize(
    "name,bf16,fp8,mib,nvlink,network,domain,host",
    [
        ("b200", 2250, 4500, 183359, 900, 50, 8, 0),
        ("gb200", 2500, 5000, 189471, 900, 50, 72, 4),
        ("b300", 2250, 4500, 275040, 900, 100, 8, 0),
        ("gb300", 2500, 5000, 284208, 900, 100, 72, 4),
    ],
)
def test_catalog_holds_the_datasheet_figures(name, bf16, fp8, mib, nvlink, network, domain, host):
    """Dense peaks (half the datasheets' sparse ones), nvidia-smi's memory.total, HBM3e at 8 TB/s,
    NVLink 5 at 900 GB/s per direction, 400 Gb/s (ConnectX-7) or 800 Gb/s (ConnectX-8) per GPU."""
    gpu = CATALOG[name]
    assert gpu.peak_flops == {"bf16": bf16 * TFLOPS, "fp16": bf16 * TFLOPS, "fp8": fp8 * TFLOPS}
    assert gpu.memory_bytes == mib * MiB and gpu.memory_bandwidth == 8000 * GB
    assert (gpu.nvlink_bandwidth, gpu.network_bandwidth) == (nvlink * GB, network * GB)
    assert (gpu.gpus_per_node, gpu.gpus_per_host, gpu.arch) == (domain, host, "blackwell")


def test_nvl72_clusters_are_whole_hosts_filling_racks():
    assert Cluster(CATALOG["gb200"], 256).gpus_per_node == 72  # 3 racks and 40 GPUs of a fourth
    assert Cluster(CATALOG["gb300"], 8).gpus_per_node == 72
    with pytest.raises(ValueError, match="not a multiple of the 4 GPUs of a gb200 host"):
        Cluster(CATALOG["gb200"], 258)
    with pytest.raises(ValueError, match="not a multiple of gpus_per_node=8"):
        Cluster(CATALOG["b200"], 260)


def test_a_catalog_file_may_give_hosts(tmp_path):
    f = tmp_path / "gpus.toml"
    text = (
        "[rack]\npeak_flops = { bf16 = 1e15 }\nmemory_bytes = 1e11\nmemory_bandwidth = 1e12\n"
        "nvlink_bandwidth = 1e11\nnetwork_bandwidth = 1e10\ngpus_per_node = 36\n"
    )
    f.write_text(text + "gpus_per_host = 4\n")
    assert Cluster(load_catalog(f)["rack"], 40).gpus_per_node == 36
    f.write_text(text + "gpus_per_host = 2.5\n")
    with pytest.raises(ValueError, match="gpus_per_host=2.5 must be a whole number"):
        load_catalog(f)


def test_deepseek_v3_on_256_gb200_plans_in_the_72_gpu_domain(capsys):
    args = ["--model", "deepseek-v3", "--gpu", "gb200", "--gpus", "256", "--global-batch-size", "4096"]
    assert cli.main(["plan", *args, "--top", "1"]) == 0
    assert "256 x gb200 (72 per node)" in capsys.readouterr().out
    fixed = dict(gpu="gb200", gpus=256, global_batch_size=4096, expert_model_parallel_size=64)
    rack, hgx = (plan("deepseek-v3", **fixed, gpus_per_node=n) for n in (None, 8))
    assert (rack.cluster.gpus_per_node, hgx.cluster.gpus_per_node) == (72, 8)
    # ep 64 runs its all-to-alls on the rack's NVLink, not over the network as with 8-GPU nodes
    assert rack.plans[0].need_time().ep_comm < 0.2 * hgx.plans[0].need_time().ep_comm
    assert any("ep 64 runs its all-to-alls inside a node" in line for line in rack.explanation)


def test_with_moe_fit_writes_the_architecture_entry_or_the_plain_fields():
    c = PerfConstants(moe_arch_fits=(("blackwell", 1.0, 1.0, 1.0, 0.0, 0.0),))
    b = c.with_moe_fit("blackwell", {"moe_layer_overhead": 1e-3})
    assert b.moe_fit("blackwell")["moe_layer_overhead"] == 1e-3 and b.moe_layer_overhead == c.moe_layer_overhead
    assert b.for_gpu(CATALOG["gb300"]).moe_layer_overhead == 1e-3
    assert b.for_gpu(CATALOG["h100"]).moe_layer_overhead == c.moe_layer_overhead
    h = c.with_moe_fit("hopper", {"moe_layer_overhead": 2e-3})
    assert h.moe_layer_overhead == 2e-3 and h.moe_arch_fits == c.moe_arch_fits
    as_json = PerfConstants(moe_arch_fits=[["blackwell", 1.0, 1.0, 1.0, 0.0, 0.0]])  # a profile read back
    assert as_json.for_gpu(CATALOG["b200"]).moe_grouped_gemm_efficiency == 1.0
