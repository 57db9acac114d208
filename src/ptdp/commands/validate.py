"""``ptdp plan --validate CSV [--update-benchmarks FILE]``: predicted vs published runs."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path

from ptdp.errors import ConfigError
from ptdp.planner.search.checks import check_output_path
from ptdp.planner.validate.accuracy import (
    fit_check,
    format_validation_table,
    h100_fit_check,
    is_h100_table,
    validate,
    validate_h100,
)
from ptdp.planner.validate.published import load_h100_runs, load_published_runs

BEGIN, END = "<!-- begin: ptdp plan --validate -->", "<!-- end: ptdp plan --validate -->"


def markers(csv: str | Path) -> tuple[str, str]:
    """The markers of ``csv``'s block in the markdown file: the plain ones for the A100 table,
    ones naming the file for an H100 table (both blocks live in BENCHMARKS.md)."""
    if not is_h100_table(csv):
        return BEGIN, END
    name = Path(csv).name
    return f"<!-- begin: ptdp plan --validate {name} -->", f"<!-- end: ptdp plan --validate {name} -->"


def validation_markdown(csv: str | Path) -> str:
    """The validation table, per-metric errors and the memory check of every published layout."""
    if is_h100_table(csv):
        h100_runs = load_h100_runs(csv)
        table, checks = format_validation_table(validate_h100(h100_runs)), h100_fit_check(h100_runs)
    else:
        published = load_published_runs(csv)
        table, checks = format_validation_table(validate(published)), fit_check(published)
    lines = [
        table,
        "",
        "Memory of each published layout under the planner's model (it must fit: the run happened):",
        "",
        "| model | layout | predicted total GiB | capacity GiB |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {label} | {total:.1f} | {cap:.0f} |" for name, label, total, cap in checks]
    return "\n".join(lines)


def update_markdown(path: Path, block: str, command: str, marks: tuple[str, str] = (BEGIN, END)) -> None:
    """Replace the text between the validation markers ``marks`` of ``path`` (appending them if absent)."""
    begin, end = marks
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    stamp = f"Written by `{command}` on {datetime.date.today().isoformat()} ({platform.machine()}, Python {platform.python_version()})."
    body = f"{begin}\n{stamp}\n\n{block}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
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
        raise ConfigError(
            f"--validate {csv}: not a published-runs table like benchmarks/data/published_runs.csv "
            f"or published_runs_h100.csv "
            f"({type(e).__name__}: {e})"
        ) from None
    print(block)
    if args.update_benchmarks:
        command = f"ptdp plan --validate {args.validate} --update-benchmarks {args.update_benchmarks}"
        update_markdown(Path(args.update_benchmarks), block, command, markers(csv))
        print(f"\nwritten into {args.update_benchmarks}")
    return 0
