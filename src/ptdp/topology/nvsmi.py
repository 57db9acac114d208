"""Parse the text of ``nvidia-smi topo -m`` into a :class:`~ptdp.topology.node.Topology`::

            GPU0    GPU1    mlx5_0  CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      NV12    SYS     48-63           3               N/A
    GPU1    NV12     X      SYS     48-63           3               N/A
    mlx5_0  SYS     SYS      X

Accepted: any text before the header (first ``GPU0`` line that is not a row); tabs and/or spaces,
empty fields between tabs; any subset of the affinity columns; any NIC names; ``N/A``; ANSI
colours. The table ends at a blank line, ``Legend:`` or the end; a ``NIC Legend:`` block
(``NIC0: mlx5_0``) fills ``NIC.device``. Anything else raises
:class:`~ptdp.topology.node.TopologyError` with the source, line number and text.
"""

from __future__ import annotations

import dataclasses
import re

from ptdp.topology.node import GPU, NIC, Topology, TopologyError, is_known_link, parse_cpu_list

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_AFFINITY = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID")
_GPU_NAME = re.compile(r"^GPU(\d+)$")
_DEVICE_NAME = re.compile(r"^[A-Za-z][\w.:-]*$")
_LEGEND_ENTRY = re.compile(r"^(NIC\d+)\s*:\s*(\S+)$")
_UNKNOWN = ("", "N/A")


@dataclasses.dataclass
class _Line:
    number: int  # 1-based, in the source text
    text: str  # without ANSI codes and trailing whitespace


@dataclasses.dataclass
class _Header:
    line: _Line
    devices: list[str]  # GPUs first (GPU0, GPU1, ...), then NICs
    affinity: list[str]  # "CPU Affinity", "NUMA Affinity", "GPU NUMA ID", in the order printed
    num_gpus: int


@dataclasses.dataclass
class _Row:
    line: _Line
    links: list[str]
    affinity: dict[str, str]  # column name -> raw value


def parse_nvidia_smi_topo(text: str, source: str = "<text>") -> Topology:
    """Parse the output of ``nvidia-smi topo -m`` (or ``-mp``); ``source`` names it in messages.

    Returns a :class:`Topology`: one :class:`GPU` per GPU row (affinity ``None`` or ``()`` where
    ``N/A``), the GPU-GPU link matrix, the NICs with their link to each GPU, ``numa_cpus`` and ``cpus``.
    Raises :class:`TopologyError` for a missing header, unknown column, row or link name, a row with
    the wrong field count, a missing row, a non-square or asymmetric matrix, or a bad CPU list or NUMA node.
    """
    lines = [_Line(i + 1, _ANSI.sub("", raw).rstrip()) for i, raw in enumerate(text.splitlines())]
    start = _find_header(lines, source)
    header = _parse_header(lines[start], source)
    rows, end = _read_rows(lines, start + 1, header, source)
    _check_matrix(header, rows, source)
    return _build(header, rows, _nic_legend(lines[end:]), source)


def _fail(source: str, line: _Line, what: str) -> TopologyError:
    return TopologyError(f"{source}: line {line.number}: {what}: {line.text.strip()!r}")


def _find_header(lines: list[_Line], source: str) -> int:
    """Index of the header line: the first line whose first word is GPU0 and second is not a link."""
    for i, line in enumerate(lines):
        words = line.text.split()
        if not words or words[0] != "GPU0":
            continue
        if len(words) > 1 and is_known_link(words[1]):
            raise _fail(source, line, "matrix row found before any header line naming the columns")
        return i
    raise TopologyError(
        f"{source}: no header line found: expected a line naming the columns "
        f"(GPU0 GPU1 ... CPU Affinity NUMA Affinity), as printed by nvidia-smi topo -m"
    )


def _parse_header(line: _Line, source: str) -> _Header:
    text = line.text.strip()
    first = _AFFINITY.search(text)
    devices = (text[: first.start()] if first else text).split()
    affinity: list[str] = []
    rest = text[first.start() :] if first else ""
    while rest:
        match = _AFFINITY.match(rest)
        if match is None:
            raise _fail(source, line, f'unknown column "{rest.split()[0]}" after the device columns')
        affinity.append(" ".join(match.group().split()))
        rest = rest[match.end() :].lstrip()
    num_gpus = 0
    while num_gpus < len(devices) and _GPU_NAME.match(devices[num_gpus]):
        num_gpus += 1
    for pos, name in enumerate(devices):
        gpu = _GPU_NAME.match(name)
        if gpu and (pos >= num_gpus or int(gpu.group(1)) != pos):
            raise _fail(
                source,
                line,
                f'GPU columns must be GPU0, GPU1, ... in order, before the NICs; found "{name}" as column {pos + 1}',
            )
        if not _DEVICE_NAME.match(name):
            raise _fail(source, line, f'"{name}" is not a device name')
    for name in devices + affinity:
        if (devices + affinity).count(name) > 1:
            raise _fail(source, line, f'column "{name}" appears twice')
    return _Header(line, devices, affinity, num_gpus)


def _fit(fields: list[str], expected: int) -> list[str]:
    """Drop surplus empty fields (doubled tabs), rightmost first, until ``expected`` remain."""
    fields = list(fields)
    i = len(fields) - 1
    while len(fields) > expected and i >= 0:
        if fields[i] == "":
            del fields[i]
        i -= 1
    return fields


def _split(text: str) -> list[str]:
    """Fields of a row: split on tabs (an empty field between two tabs is kept) and on spaces."""
    fields: list[str] = []
    for chunk in text.strip().split("\t"):
        fields.extend(chunk.split() or [""])
    return fields


def _read_rows(lines: list[_Line], start: int, header: _Header, source: str) -> tuple[dict[str, _Row], int]:
    """The matrix rows after the header, by device name; and the index of the first line after them."""
    rows: dict[str, _Row] = {}
    n, k = len(header.devices), len(header.affinity)
    i = start
    while i < len(lines):
        line = lines[i]
        stripped = line.text.strip()
        if not stripped:
            if rows:
                break
            i += 1
            continue
        if stripped.startswith(("Legend:", "NIC Legend:")):
            break
        fields = _split(stripped)
        name = fields[0]
        if name not in header.devices:
            raise _fail(
                source,
                line,
                f'row "{name}" is not one of the header\'s columns '
                f"({' '.join(header.devices)}, header on line {header.line.number})",
            )
        if name in rows:
            raise _fail(source, line, f"second row for {name} (first on line {rows[name].line.number})")
        is_gpu = header.devices.index(name) < header.num_gpus
        expected = 1 + n + k
        fields = _fit(fields, expected)
        if not is_gpu and len(fields) > 1 + n and all(f in _UNKNOWN for f in fields[1 + n :]):
            fields = fields[: 1 + n]  # a NIC row with empty or N/A affinity fields
        if len(fields) != expected and (is_gpu or len(fields) != 1 + n):
            names = ", ".join(header.affinity)
            raise _fail(
                source,
                line,
                f"row {name} has {len(fields)} fields, expected {expected} "
                f"(name, {n} links{', ' + names if names else ''})",
            )
        rows[name] = _Row(line, fields[1 : 1 + n], dict(zip(header.affinity, fields[1 + n :])))
        i += 1
    return rows, i


def _check_matrix(header: _Header, rows: dict[str, _Row], source: str) -> None:
    """Every column has a row; links are known names, X exactly on the diagonal, and symmetric."""
    devices = header.devices
    for name in devices:
        if name not in rows:
            what = "GPU row missing" if devices.index(name) < header.num_gpus else "NIC row missing"
            raise _fail(
                source,
                header.line,
                f"{what}: no row for {name}, so the matrix is not square ({len(devices)} columns, {len(rows)} rows)",
            )
    for i, name in enumerate(devices):
        row = rows[name]
        for j, link in enumerate(row.links):
            if link == "":
                raise _fail(source, row.line, f"empty link field in column {devices[j]} of row {name}")
            if not is_known_link(link):
                raise _fail(
                    source,
                    row.line,
                    f'unknown link name "{link}" in column {devices[j]} of row '
                    f"{name} (expected X, NV#, PIX, PXB, PHB, NODE or SYS)",
                )
            if (link == "X") != (i == j):
                what = "X off the diagonal" if link == "X" else f'"{link}" on the diagonal, expected X'
                raise _fail(source, row.line, f"{what} (row {name}, column {devices[j]})")
    for i, name in enumerate(devices):
        for j in range(i):
            there, back = rows[name].links[j], rows[devices[j]].links[i]
            if there != back:
                raise _fail(
                    source,
                    rows[name].line,
                    f"asymmetric matrix: {name} -> {devices[j]} is {there} but {devices[j]} -> "
                    f"{name} is {back} (line {rows[devices[j]].line.number})",
                )


def _affinity(row: _Row, source: str) -> tuple[tuple[int, ...], int | None]:
    """CPU list and NUMA node of a GPU row (empty / None where N/A or absent)."""
    cpus_text = row.affinity.get("CPU Affinity", "")
    try:
        cpus = () if cpus_text in _UNKNOWN else parse_cpu_list(cpus_text)
    except TopologyError as e:
        raise _fail(source, row.line, f"CPU Affinity: {e}") from None
    numa: int | None = None
    for column in ("NUMA Affinity", "GPU NUMA ID"):
        value = row.affinity.get(column, "")
        if value not in _UNKNOWN and not value.isdigit():
            raise _fail(source, row.line, f'{column} "{value}" is not a NUMA node number (or N/A)')
        if column == "NUMA Affinity" and value not in _UNKNOWN:
            numa = int(value)
    return cpus, numa


def _nic_legend(lines: list[_Line]) -> dict[str, str]:
    """``NIC0 -> mlx5_0`` from a ``NIC Legend:`` block, if any."""
    legend: dict[str, str] = {}
    inside = False
    for line in lines:
        stripped = line.text.strip()
        if stripped == "NIC Legend:":
            inside = True
        elif inside and stripped:
            match = _LEGEND_ENTRY.match(stripped)
            if not match:
                break
            legend[match.group(1)] = match.group(2)
    return legend


def _build(header: _Header, rows: dict[str, _Row], legend: dict[str, str], source: str) -> Topology:
    n_gpu = header.num_gpus
    gpu_rows = [rows[name] for name in header.devices[:n_gpu]]
    gpus = []
    numa_cpus: dict[int, set[int]] = {}
    all_cpus: set[int] = set()
    for index, row in enumerate(gpu_rows):
        cpus, numa = _affinity(row, source)
        gpus.append(GPU(index=index, numa_node=numa, cpus=cpus))
        all_cpus.update(cpus)
        if numa is not None and cpus:
            numa_cpus.setdefault(numa, set()).update(cpus)
    links = tuple(tuple(row.links[:n_gpu]) for row in gpu_rows)
    nics = tuple(
        NIC(name=name, links=tuple(row.links[n_gpu + k] for row in gpu_rows), device=legend.get(name))
        for k, name in enumerate(header.devices[n_gpu:])
    )
    return Topology(
        gpus=tuple(gpus),
        links=links,
        nics=nics,
        numa_cpus={node: tuple(sorted(cpus)) for node, cpus in sorted(numa_cpus.items())},
        cpus=tuple(sorted(all_cpus)),
        source=source,
    )
