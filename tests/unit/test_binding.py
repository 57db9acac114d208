"""CPU binding (``--bind-cpus``): the pure choice of CPUs per local rank on many node shapes, the
sysfs readers on a fake tree, and real workers binding themselves under torchrun and ``ptdp train``."""

from __future__ import annotations

import os

import pytest

from ptdp.config.flags import config_from_args
from ptdp.config.resolve import resolve
from ptdp.config.train_flags import add_train_arguments
from ptdp.errors import ConfigError
from ptdp.topology.binding import (
    BindingError,
    CpuLayout,
    GpuCpus,
    allowed_numa_nodes,
    exclusive_shares,
    plan_cpu_only,
    plan_gpus,
    read_cpu_layout,
    read_gpu_cpus,
    read_node_plan,
)

# Two sockets x 4 cores x 2 hyperthreads: node 0 = cores 0-3 (CPUs 0-3 and siblings 8-11),
# node 1 = cores 4-7 (CPUs 4-7 and siblings 12-15), Linux's usual numbering.
TWO_SOCKETS = CpuLayout(
    allowed=tuple(range(16)),
    numa_cpus={0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15)},
    core_of={c: c % 8 for c in range(16)},
)


def assert_partition(shares, cpus) -> None:
    """Non-empty, pairwise disjoint shares covering exactly ``cpus``."""
    assert all(shares)
    flat = [c for s in shares for c in s]
    assert len(flat) == len(set(flat)), f"shares overlap: {shares}"
    assert set(flat) == set(cpus)


def test_exclusive_keeps_hyperthread_siblings_together():
    plan = plan_cpu_only("exclusive", 4, TWO_SOCKETS)
    cpus = [b.cpus for b in plan.bindings]
    assert cpus == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    assert [b.threads for b in plan.bindings] == [4, 4, 4, 4]
    assert [b.where for b in plan.bindings] == ["NUMA node 0"] * 2 + ["NUMA node 1"] * 2
    assert plan.warnings == ()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8])
def test_exclusive_is_an_even_partition_of_whole_cores(n):
    plan = plan_cpu_only("exclusive", n, TWO_SOCKETS)
    shares = [b.cpus for b in plan.bindings]
    assert_partition(shares, range(16))
    cores = [{c % 8 for c in s} for s in shares]
    assert max(map(len, cores)) - min(map(len, cores)) <= 1
    assert all(len(s) == 2 * len(c) for s, c in zip(shares, cores)), "a core was split"
    assert plan.warnings == ()


def test_exclusive_more_workers_than_cores_splits_siblings_then_shares():
    plan = plan_cpu_only("exclusive", 12, TWO_SOCKETS)  # 8 cores < 12 workers <= 16 CPUs
    assert_partition([b.cpus for b in plan.bindings], range(16))
    assert "hyperthread siblings" in plan.warnings[0]

    two = CpuLayout(allowed=(0, 1))
    plan = plan_cpu_only("exclusive", 5, two)  # 5 workers on 2 CPUs
    assert [b.cpus for b in plan.bindings] == [(0,), (0,), (0,), (1,), (1,)]
    assert all(b.threads == 1 for b in plan.bindings)
    assert "shared by 2 or 3 consecutive local ranks" in plan.warnings[0]
    shares, note = exclusive_shares([3, 1], 4)
    assert shares == [(3,), (3,), (1,), (1,)] and "shared by 2 consecutive" in note


def test_exclusive_respects_the_allowed_cpus():
    # e.g. Slurm gave this job CPUs 2, 3, 10, 11 (two cores of node 0) and 4, 12 (one core of node 1)
    layout = CpuLayout(allowed=(2, 3, 4, 10, 11, 12), numa_cpus=TWO_SOCKETS.numa_cpus, core_of=TWO_SOCKETS.core_of)
    plan = plan_cpu_only("exclusive", 3, layout)
    assert [b.cpus for b in plan.bindings] == [(2, 10), (3, 11), (4, 12)]
    plan = plan_cpu_only("exclusive", 2, layout)
    assert [b.cpus for b in plan.bindings] == [(2, 3, 10, 11), (4, 12)]


def test_numa_spreads_workers_in_blocks_over_the_nodes():
    plan = plan_cpu_only("numa", 8, TWO_SOCKETS)
    node0, node1 = TWO_SOCKETS.numa_cpus[0], TWO_SOCKETS.numa_cpus[1]
    assert [b.cpus for b in plan.bindings] == [node0] * 4 + [node1] * 4
    assert all(b.threads == 2 for b in plan.bindings)  # 8 CPUs shared by 4 workers
    plan = plan_cpu_only("numa", 3, TWO_SOCKETS)
    assert [b.cpus for b in plan.bindings] == [node0, node0, node1]
    assert [b.threads for b in plan.bindings] == [4, 4, 8]

    four = CpuLayout(allowed=tuple(range(8)), numa_cpus={n: (2 * n, 2 * n + 1) for n in range(4)})
    assert [b.where for b in plan_cpu_only("numa", 2, four).bindings] == ["NUMA node 0", "NUMA node 2"]
    # a node with no allowed CPU is not used; the others keep only their allowed CPUs
    partly = CpuLayout(allowed=(0, 1, 5), numa_cpus=four.numa_cpus)
    assert allowed_numa_nodes(partly) == {0: (0, 1), 2: (5,)}
    assert [b.cpus for b in plan_cpu_only("numa", 2, partly).bindings] == [(0, 1), (5,)]


def test_no_numa_information_is_one_node_of_all_allowed_cpus():
    layout = CpuLayout(allowed=(0, 1, 2, 3))
    assert allowed_numa_nodes(layout) == {0: (0, 1, 2, 3)}
    assert [b.cpus for b in plan_cpu_only("numa", 2, layout).bindings] == [(0, 1, 2, 3)] * 2
    hidden = CpuLayout(allowed=(0, 1), numa_cpus={0: (8, 9)})  # sysfs names CPUs we may not use
    assert allowed_numa_nodes(hidden) == {0: (0, 1)}


def test_none_unknown_policy_and_no_cpu():
    assert all(b.cpus is None for b in plan_cpu_only("none", 3, TWO_SOCKETS).bindings)
    with pytest.raises(BindingError, match="must be one of"):
        plan_cpu_only("spread", 2, TWO_SOCKETS)
    with pytest.raises(BindingError, match="allowed no CPU"):
        plan_cpu_only("exclusive", 2, CpuLayout(allowed=()))
    assert issubclass(BindingError, ConfigError)


EIGHT_GPUS = [GpuCpus(0)] * 4 + [GpuCpus(1)] * 4  # GPUs 0-3 on node 0, 4-7 on node 1


def test_gpu_numa_binds_to_the_gpus_node():
    plan = plan_gpus("numa", EIGHT_GPUS, TWO_SOCKETS)
    assert [b.cpus for b in plan.bindings] == [TWO_SOCKETS.numa_cpus[0]] * 4 + [TWO_SOCKETS.numa_cpus[1]] * 4
    assert all(b.threads == 2 for b in plan.bindings)


def test_gpu_exclusive_splits_each_node_between_its_gpus():
    plan = plan_gpus("exclusive", EIGHT_GPUS, TWO_SOCKETS)
    shares = [b.cpus for b in plan.bindings]
    assert shares[:4] == [(0, 8), (1, 9), (2, 10), (3, 11)] and shares[4:] == [(4, 12), (5, 13), (6, 14), (7, 15)]
    assert_partition(shares, range(16))
    # GPUs unevenly spread: 1 on node 0, 3 on node 1
    plan = plan_gpus("exclusive", [GpuCpus(1), GpuCpus(0), GpuCpus(1), GpuCpus(1)], TWO_SOCKETS)
    shares = [b.cpus for b in plan.bindings]
    assert shares[1] == TWO_SOCKETS.numa_cpus[0]
    assert_partition([shares[0], shares[2], shares[3]], TWO_SOCKETS.numa_cpus[1])


def test_gpu_restricted_unknown_and_unreachable():
    # only half of node 1 allowed: its GPUs share what is allowed
    layout = CpuLayout(allowed=(0, 1, 2, 3, 4, 5, 12, 13), numa_cpus=TWO_SOCKETS.numa_cpus, core_of=TWO_SOCKETS.core_of)
    plan = plan_gpus("exclusive", [GpuCpus(1), GpuCpus(1)], layout)
    assert [b.cpus for b in plan.bindings] == [(4, 12), (5, 13)]
    # node unknown (-1 in sysfs): the GPU's local_cpulist; unknown position: not bound, warned
    plan = plan_gpus("numa", [GpuCpus(None, (0, 1, 2)), None], layout)
    assert plan.bindings[0].cpus == (0, 1, 2) and plan.bindings[1].cpus is None
    assert "GPU 1" in plan.warnings[0] and "not bound" in plan.describe()
    # the GPU's node has no allowed CPU: a clear error naming both sets
    with pytest.raises(BindingError, match=r"GPU 0 sits on NUMA node 1 \(CPUs 4-7,12-15\).*CPUs 0-3"):
        plan_gpus("numa", [GpuCpus(1)], CpuLayout(allowed=(0, 1, 2, 3), numa_cpus=TWO_SOCKETS.numa_cpus))


def test_readers_on_a_fake_sysfs(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    for node, cpus in {0: "0-3", 1: "4-7"}.items():
        (tmp_path / f"devices/system/node/node{node}").mkdir(parents=True)
        (tmp_path / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    (tmp_path / "devices/system/node/possible").write_text("0-1\n")
    for cpu in allowed:
        topo = tmp_path / f"devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        topo.joinpath("thread_siblings_list").write_text(f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}\n")
    layout = read_cpu_layout(tmp_path)
    assert layout.allowed == tuple(allowed) and layout.numa_cpus == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert layout.core_of == {cpu: cpu - cpu % 2 for cpu in allowed}
    gpu = tmp_path / "bus/pci/devices/0000:1b:00.0"
    gpu.mkdir(parents=True)
    gpu.joinpath("numa_node").write_text("1\n")
    gpu.joinpath("local_cpulist").write_text("4-7\n")
    single = tmp_path / "bus/pci/devices/0000:2c:00.0"
    single.mkdir(parents=True)
    single.joinpath("numa_node").write_text("-1\n")
    assert read_gpu_cpus(["0000:1b:00.0", "0000:2c:00.0", "0000:ff:00.0", None], tmp_path) == [
        GpuCpus(1, (4, 5, 6, 7)),
        GpuCpus(None, ()),
        None,
        None,
    ]
    assert len(read_node_plan("exclusive", 2, use_gpus=False, sysfs=tmp_path).bindings) == 2
    (tmp_path / "devices/system/node/node1/cpulist").write_text("4-\n")
    with pytest.raises(BindingError, match="node1/cpulist"):
        read_node_plan("numa", 2, use_gpus=False, sysfs=tmp_path)


def test_flag_reaches_the_config_and_bad_values_are_rejected():
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser, local_launch=True)
    config = resolve(config_from_args(parser.parse_args(["--bind-cpus", "exclusive", "--dp", "2"])), 8)
    assert config.parallel.bind_cpus == "exclusive"
    assert config_from_args(parser.parse_args([])).parallel.bind_cpus == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--bind-cpus", "spread"])
    bad = config_from_args(parser.parse_args([]))
    bad = bad.__class__(
        **{**bad.__dict__, "parallel": bad.parallel.__class__(**{**bad.parallel.__dict__, "bind_cpus": "spread"})}
    )
    with pytest.raises(ConfigError, match="bind_cpus='spread' must be one of"):
        resolve(bad, 8)
