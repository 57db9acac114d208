"""``ptdp plan --validate CSV [--update-benchmarks FILE]``: predicted vs published runs."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

from ptdp.spec import ConfigError
from ptdp.planner.request import check_output_path
from ptdp.planner.validate import fit_check, format_validation_table, load_published_runs, validate

BEGIN, END = "<!-- begin: ptdp plan --validate -->", "<!-- end: ptdp plan --validate -->"


def validation_markdown(csv: str | Path) -> str:
    """The validation table, per-metric errors and the memory check of every published layout."""
    runs = load_published_runs(csv)
    lines = [format_validation_table(validate(runs)), "",
             "Memory of each published layout under the planner's model (it must fit: the run happened):", "",
             "| model | layout | predicted total GiB | capacity GiB |", "|---|---|---|---|"]
    lines += [f"| {name} | {label} | {total:.1f} | {cap:.0f} |" for name, label, total, cap in fit_check(runs)]
    return "\n".join(lines)


def update_markdown(path: Path, block: str, command: str) -> None:
    """Replace the text between the validation markers of ``path`` (appending them if absent)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    stamp = f"Written by `{command}` on {datetime.date.today().isoformat()} ({platform.machine()}, Python {platform.python_version()})."
    body = f"{BEGIN}\n{stamp}\n\n{block}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + body + tail
    else:
        text = text.rstrip() + "\n\n## Planner validation against published runs\n\n" + body + "\n"
    path.write_text(text, encoding="utf-8")


def run_validation(args: argparse.Namespace) -> int:
    csv = Path(args.validate)
    if not csv.is_file():
        raise ConfigError(f"--validate {csv}: no such file")
    if args.update_benchmarks:
        check_output_path(args.update_benchmarks, "--update-benchmarks", (".md",))
    try:
        block = validation_markdown(csv)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"--validate {csv}: not a published-runs table like benchmarks/data/published_runs.csv "
                          f"({type(e).__name__}: {e})") from None
    print(block)
    if args.update_benchmarks:
        command = f"ptdp plan --validate {args.validate} --update-benchmarks {args.update_benchmarks}"
        update_markdown(Path(args.update_benchmarks), block, command)
        print(f"\nwritten into {args.update_benchmarks}")
    return 0
