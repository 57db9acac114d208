"""Topology sources: ``nvidia-smi topo -m`` text (the saved outputs in tests/data/topo and
variants of them), fake sysfs trees, the CPU-only description and ``local_topology``."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from ptdp.topology import sysfs
from ptdp.topology.node import TopologyError, format_cpu_list, parse_cpu_list
from ptdp.topology.nvsmi import parse_nvidia_smi_topo
from ptdp.topology.sysfs import cpu_topology, from_sysfs, local_topology

DATA = Path(__file__).parents[1] / "data" / "topo"
HGX = DATA / "hgx_a100_8gpu_nvswitch.txt"
NV4 = DATA / "nvlink_4gpu_nv4_4nic.txt"
PCIE = DATA / "pcie_8x4090_no_nvlink.txt"


def rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()]


HGX_LINKS = rows("""
X    NV12 NV12 NV12 NV12 NV12 NV12 NV12
NV12 X    NV12 NV12 NV12 NV12 NV12 NV12
NV12 NV12 X    NV12 NV12 NV12 NV12 NV12
NV12 NV12 NV12 X    NV12 NV12 NV12 NV12
NV12 NV12 NV12 NV12 X    NV12 NV12 NV12
NV12 NV12 NV12 NV12 NV12 X    NV12 NV12
NV12 NV12 NV12 NV12 NV12 NV12 X    NV12
NV12 NV12 NV12 NV12 NV12 NV12 NV12 X
""")
NV4_LINKS = rows("""
X   NV4 NV4 NV4
NV4 X   NV4 NV4
NV4 NV4 X   NV4
NV4 NV4 NV4 X
""")
PCIE_LINKS = rows("""
X   SYS SYS SYS SYS SYS SYS SYS
SYS X   SYS SYS SYS SYS SYS SYS
SYS SYS X   SYS SYS SYS SYS SYS
SYS SYS SYS X   SYS SYS SYS SYS
SYS SYS SYS SYS X   SYS SYS SYS
SYS SYS SYS SYS SYS X   SYS SYS
SYS SYS SYS SYS SYS SYS X   SYS
SYS SYS SYS SYS SYS SYS SYS X
""")

EXPECTED = {
    HGX: dict(
        links=HGX_LINKS,
        numa=[3, 3, 1, 1, 7, 7, 5, 5],
        cpus=["48-63", "48-63", "16-31", "16-31", "112-127", "112-127", "80-95", "80-95"],
        nics={"mlx5_0": "SYS SYS PXB PXB SYS SYS SYS SYS"},
        numa_cpus={1: "16-31", 3: "48-63", 5: "80-95", 7: "112-127"},
        all_cpus="16-31,48-63,80-95,112-127",
    ),
    NV4: dict(
        links=NV4_LINKS,
        numa=[0, 0, 0, 0],
        cpus=["0-15"] * 4,
        nics={
            "mlx5_0": "PXB NODE NODE NODE",
            "mlx5_1": "NODE PXB NODE NODE",
            "mlx5_2": "NODE NODE PXB NODE",
            "mlx5_3": "NODE NODE NODE PXB",
        },
        numa_cpus={0: "0-15"},
        all_cpus="0-15",
    ),
    PCIE: dict(
        links=PCIE_LINKS,
        numa=[0, 0, 0, 0, 1, 1, 1, 1],
        cpus=["0-55,112-167"] * 4 + ["56-111,168-223"] * 4,
        nics={"NIC0": "SYS SYS SYS SYS SYS SYS PHB SYS", "NIC1": "SYS SYS SYS SYS SYS SYS PHB SYS"},
        numa_cpus={0: "0-55,112-167", 1: "56-111,168-223"},
        all_cpus="0-223",
    ),
}


def check(topo, expected: dict) -> None:
    n = len(expected["numa"])
    assert topo.num_gpus == n and [g.index for g in topo.gpus] == list(range(n))
    assert [list(row) for row in topo.links] == expected["links"]
    assert [g.numa_node for g in topo.gpus] == expected["numa"]
    assert [g.cpus for g in topo.gpus] == [parse_cpu_list(c) for c in expected["cpus"]]
    assert {nic.name: " ".join(nic.links) for nic in topo.nics} == expected["nics"]
    assert [nic.name for nic in topo.nics] == list(expected["nics"])
    assert topo.numa_cpus == {k: parse_cpu_list(v) for k, v in expected["numa_cpus"].items()}
    assert topo.cpus == parse_cpu_list(expected["all_cpus"])


@pytest.mark.parametrize("path", [HGX, NV4, PCIE], ids=lambda p: p.stem)
def test_saved_outputs_parse_to_the_expected_topology(path):
    topo = parse_nvidia_smi_topo(path.read_text(), source=str(path))
    check(topo, EXPECTED[path])
    assert topo.source == str(path)
    assert all(nic.device is None for nic in topo.nics)


def test_cpu_lists_expand_and_print_back():
    cpus = parse_cpu_list("0-55,112-167")
    assert len(cpus) == 112 and cpus[:2] == (0, 1) and cpus[55:57] == (55, 112) and cpus[-1] == 167
    assert format_cpu_list(cpus) == "0-55,112-167"
    assert parse_cpu_list("3") == (3,) and parse_cpu_list("") == () and format_cpu_list([5, 1, 2, 3]) == "1-3,5"
    for bad in ("0-", "5-3", "a", "1,,2", "-1"):
        with pytest.raises(TopologyError, match="bad CPU list"):
            parse_cpu_list(bad)


def _table_lines(text: str) -> tuple[list[str], list[str], list[str]]:
    """(lines before the header, the table lines, lines after it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"])
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[:start], lines[start:end], lines[end:]


@pytest.mark.parametrize("path", [HGX, NV4, PCIE], ids=lambda p: p.stem)
def test_tabs_and_spaces_are_interchangeable(path):
    before, table, after = _table_lines(path.read_text())
    tabbed = [re.sub(r" {2,}", "\t", line) for line in table]
    spaced = [line.expandtabs(8) for line in table]
    for variant in (tabbed, spaced):
        check(parse_nvidia_smi_topo("\n".join(before + variant + after)), EXPECTED[path])


def test_ansi_colours_and_trailing_whitespace_are_ignored():
    text = HGX.read_text()
    coloured = re.sub(r"(NV12|SYS|PXB)", "\x1b[1;32m\\1\x1b[0m", text)
    coloured = "\n".join(line + "  \t " for line in coloured.splitlines()).replace("\n", "\r\n")
    check(parse_nvidia_smi_topo(coloured), EXPECTED[HGX])


def test_without_affinity_columns_numa_and_cpus_are_unknown():
    before, table, after = _table_lines(NV4.read_text())
    header = table[0].split("CPU Affinity")[0]
    cut = [header] + [" ".join(line.split()[:9]) for line in table[1:]]
    topo = parse_nvidia_smi_topo("\n".join(cut))
    assert [list(r) for r in topo.links] == NV4_LINKS
    assert [g.numa_node for g in topo.gpus] == [None] * 4 and all(g.cpus == () for g in topo.gpus)
    assert topo.numa_cpus == {} and topo.cpus == ()
    assert {nic.name: " ".join(nic.links) for nic in topo.nics} == EXPECTED[NV4]["nics"]


def test_na_values_and_doubled_tabs_of_a_single_gpu():
    text = (
        "$ nvidia-smi topo -m\n"
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \t0-7\t\tN/A\t\tN/A\n"
        "\nLegend:\n\n  X    = Self\n"
    )
    topo = parse_nvidia_smi_topo(text)
    assert topo.num_gpus == 1 and topo.links == (("X",),)
    assert topo.gpus[0].numa_node is None and topo.gpus[0].cpus == tuple(range(8))
    assert topo.numa_cpus == {} and topo.cpus == tuple(range(8))
    na_cpus = text.replace("0-7", "N/A")
    assert parse_nvidia_smi_topo(na_cpus).gpus[0].cpus == ()


def test_nic_legend_names_the_devices():
    text = (
        "\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\tPIX\tSYS\t0-23\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tSYS\tPIX\t24-47\t1\t\tN/A\n"
        "NIC0\tPIX\tSYS\t X \tSYS\n"
        "NIC1\tSYS\tPIX\tSYS\t X \n"
        "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
        "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_3\n"
    )
    topo = parse_nvidia_smi_topo(text)
    assert [(n.name, n.device, n.links) for n in topo.nics] == [
        ("NIC0", "mlx5_0", ("PIX", "SYS")),
        ("NIC1", "mlx5_3", ("SYS", "PIX")),
    ]
    assert topo.numa_cpus == {0: tuple(range(24)), 1: tuple(range(24, 48))}


def _hgx_with(old: str, new: str, count: int = 1) -> str:
    text = HGX.read_text()
    assert old in text
    return text.replace(old, new, count)


GPU3_ROW = "GPU3    NV12    NV12    NV12     X      NV12    NV12    NV12    NV12    PXB     16-31   1"
MALFORMED = [
    # (text, line number in the message, words the message must contain)
    (
        _hgx_with(GPU3_ROW, GPU3_ROW.replace("NV12    NV12    PXB", "NVX     NV12    PXB")),
        7,
        ['unknown link name "NVX"', "column GPU6 of row GPU3"],
    ),
    (_hgx_with(GPU3_ROW, GPU3_ROW.replace("PXB     ", "")), 7, ["row GPU3 has 11 fields, expected 12"]),
    (_hgx_with(GPU3_ROW + "\n", ""), 3, ["GPU row missing", "no row for GPU3", "not square"]),
    (
        _hgx_with("mlx5_0  SYS     SYS     PXB     PXB     SYS     SYS     SYS     SYS      X\n", ""),
        3,
        ["NIC row missing", "no row for mlx5_0"],
    ),
    (_hgx_with("112-127 7", "112- 7"), 8, ['bad CPU list "112-"', "CPU Affinity"]),
    (_hgx_with("48-63   3", "48-63   x"), 4, ['NUMA Affinity "x" is not a NUMA node number']),
    (_hgx_with("NUMA Affinity", "NUMA Afinity"), 3, ['unknown column "NUMA"']),
    (_hgx_with("GPU1    NV12     X ", "GPU1    NV12     SYS"), 5, ['"SYS" on the diagonal']),
    (
        _hgx_with("GPU2    NV12    NV12     X ", "GPU2    NV4     NV12     X "),
        6,
        ["asymmetric matrix: GPU2 -> GPU0 is NV4 but GPU0 -> GPU2 is NV12 (line 4)"],
    ),
    (_hgx_with("GPU7    NV12", "GPU9    NV12"), 11, ['row "GPU9" is not one of the header\'s columns']),
    (_hgx_with("GPU6    NV12", "GPU5    NV12"), 10, ["second row for GPU5 (first on line 9)"]),
    (_hgx_with("GPU0    GPU1    GPU2", "GPU0    GPU2    GPU1"), 3, ["GPU columns must be GPU0, GPU1"]),
]


@pytest.mark.parametrize("text, line, words", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_input_names_source_line_and_problem(text, line, words):
    with pytest.raises(TopologyError) as info:
        parse_nvidia_smi_topo(text, source="node7.txt")
    message = str(info.value)
    assert message.startswith(f"node7.txt: line {line}: "), message
    for word in words:
        assert word in message, message


def test_no_header_is_an_error():
    with pytest.raises(TopologyError, match=r"^x\.txt: no header line found"):
        parse_nvidia_smi_topo("# nothing here\n$ nvidia-smi topo -m\nNo devices were found\n", source="x.txt")
    with pytest.raises(TopologyError, match="line 1: matrix row found before any header"):
        parse_nvidia_smi_topo("GPU0 X NV4\nGPU1 NV4 X\n")


# --- sysfs ---------------------------------------------------------------------------------------


def _pci(root: Path, address: str, vendor: str, cls: str, numa: str | None = None, cpus: str | None = None):
    dev = root / "bus" / "pci" / "devices" / address
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    (dev / "class").write_text(cls + "\n")
    if numa is not None:
        (dev / "numa_node").write_text(numa + "\n")
    if cpus is not None:
        (dev / "local_cpulist").write_text(cpus + "\n")


def _nodes(root: Path, cpulists: dict[int, str]) -> None:
    for node, cpus in cpulists.items():
        folder = root / "devices" / "system" / "node" / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpus + "\n")
    (root / "devices" / "system" / "node" / "online").write_text("0-1\n")


@pytest.fixture
def fake_sys(tmp_path) -> Path:
    root = tmp_path / "sys"
    _pci(root, "0000:b1:00.0", "0x10de", "0x030200", "1", "8-15")
    _pci(root, "0000:17:00.0", "0x10de", "0x030000", "0", "0-7")
    _pci(root, "0000:17:00.1", "0x10de", "0x040300", "0", "0-7")  # the GPU's audio function
    _pci(root, "0000:00:02.0", "0x8086", "0x030000", "-1", "0-15")  # another vendor's display
    _pci(root, "0000:65:00.0", "0x10de", "0x030200", "-1", "0-15")
    _pci(root, "0000:18:00.0", "0x10de", "0x030200", "0", "0-7")
    _pci(root, "0000:ca:00.0", "0x15b3", "0x020700", "1", "8-15")  # a NIC
    _nodes(root, {0: "0-7", 1: "8-15", 2: ""})
    return root


def test_sysfs_gpus_in_bus_order_with_numa_links(fake_sys):
    topo = from_sysfs(fake_sys)
    # bus order: 17 (node 0), 18 (node 0), 65 (unknown), b1 (node 1)
    assert [(g.index, g.numa_node, format_cpu_list(g.cpus)) for g in topo.gpus] == [
        (0, 0, "0-7"),
        (1, 0, "0-7"),
        (2, None, "0-15"),
        (3, 1, "8-15"),
    ]
    assert [list(r) for r in topo.links] == rows("""
        X    NODE SYS  SYS
        NODE X    SYS  SYS
        SYS  SYS  X    SYS
        SYS  SYS  SYS  X
    """)
    assert topo.nics == () and topo.numa_cpus == {0: tuple(range(8)), 1: tuple(range(8, 16))}
    assert topo.cpus == tuple(range(16)) and str(fake_sys) in topo.source


def test_sysfs_errors_name_the_file(fake_sys):
    bad = fake_sys / "bus" / "pci" / "devices" / "0000:18:00.0"
    (bad / "local_cpulist").write_text("0-\n")
    with pytest.raises(TopologyError, match=r"0000:18:00\.0/local_cpulist: bad CPU list \"0-\""):
        from_sysfs(fake_sys)
    (bad / "local_cpulist").write_text("0-7\n")
    (bad / "numa_node").write_text("zero\n")
    with pytest.raises(TopologyError, match=r"0000:18:00\.0/numa_node: expected a NUMA node number"):
        from_sysfs(fake_sys)
    (bad / "numa_node").write_text("0\n")
    (fake_sys / "devices" / "system" / "node" / "node1" / "cpulist").write_text("8-x\n")
    with pytest.raises(TopologyError, match=r"node1/cpulist: bad CPU list"):
        cpu_topology(fake_sys, allowed={0})


def test_sysfs_without_gpus_or_pci(tmp_path):
    topo = from_sysfs(tmp_path)
    assert topo.num_gpus == 0 and topo.links == () and topo.numa_cpus == {} and topo.cpus == ()


def test_cpu_topology_keeps_the_allowed_cpus(fake_sys, tmp_path):
    topo = cpu_topology(fake_sys, allowed={1, 2, 9})
    assert topo.gpus == () and topo.links == ()
    assert topo.numa_cpus == {0: (1, 2), 1: (9,)} and topo.cpus == (1, 2, 9)
    only_node1 = cpu_topology(fake_sys, allowed={12, 13})
    assert only_node1.numa_cpus == {1: (12, 13)}
    fallback = cpu_topology(tmp_path / "empty", allowed={3, 0, 1})
    assert fallback.numa_cpus == {0: (0, 1, 3)} and fallback.cpus == (0, 1, 3)
    mine = cpu_topology(tmp_path / "empty")
    assert set(mine.cpus) == os.sched_getaffinity(0) and mine.numa_cpus == {0: mine.cpus}


def test_local_topology_prefers_nvidia_smi_then_sysfs_then_cpus(fake_sys, tmp_path, monkeypatch):
    monkeypatch.setattr(sysfs.shutil, "which", lambda name: None)
    assert local_topology(fake_sys).num_gpus == 4
    assert local_topology(tmp_path / "empty").numa_cpus == {0: tuple(sorted(os.sched_getaffinity(0)))}
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat '{NV4}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sysfs.shutil, "which", lambda name: str(fake))
    topo = local_topology(fake_sys)
    check(topo, EXPECTED[NV4])
    assert topo.source == "nvidia-smi topo -m"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    assert local_topology(fake_sys).source.startswith("sysfs")
