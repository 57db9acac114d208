"""``ptdp plan --validate CSV [CSV ...] [--update-benchmarks FILE]``: predicted vs published runs."""

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
    loso_a100,
    loso_h100,
    validate,
    validate_h100,
)
from ptdp.planner.validate.published import H100Run, load_h100_runs, load_published_runs
from ptdp.planner.validate.published_moe import (
    MOE_GRID,
    MoERun,
    fit_moe_constants,
    is_moe_table,
    load_moe_runs,
    memory_checks,
    moe_errors,
    unread_columns,
)

BEGIN, END = "<!-- begin: ptdp plan --validate -->", "<!-- end: ptdp plan --validate -->"
POOLED = (
    "<!-- begin: ptdp plan --validate, H100 tables together -->",
    "<!-- end: ptdp plan --validate, H100 tables together -->",
)


def markers(csv: str | Path) -> tuple[str, str]:
    """The markers of ``csv``'s block in the markdown file: the plain ones for
    ``published_runs.csv``, ones naming the file for any other table."""
    if Path(csv).name == "published_runs.csv":
        return BEGIN, END
    name = Path(csv).name
    return f"<!-- begin: ptdp plan --validate {name} -->", f"<!-- end: ptdp plan --validate {name} -->"


def moe_validation_markdown(runs: list[MoERun]) -> str:
    """The MoE table's runs: published and predicted step time of each (the planner's constants, and
    with the MoE constants refitted without the run's source), the summary, the memory check."""
    rows = moe_errors(runs)
    held: dict[int, float] = {}  # by row: two runs may share a layout and differ in their time
    sources = list(dict.fromkeys(run.source_key for run in runs))
    for source in sources if len(sources) > 1 else []:  # one source: nothing to refit on
        mine = [i for i, run in enumerate(runs) if run.source_key == source]
        refit = fit_moe_constants([run for run in runs if run.source_key != source])
        for i, (_, _, error) in zip(mine, moe_errors([runs[i] for i in mine], refit)):
            held[i] = error
    lines = [
        "| model | source | ptdp plan flags | published s/step | predicted s/step | error | error, source left out |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (run, plan, error) in enumerate(rows):
        predicted = "rules refuse it" if plan is None else f"{plan.need_time().step:.2f}"
        predicted += " (over memory)" if plan is not None and not plan.fits else ""
        lines.append(
            f"| {run.name} | {run.source_key} | `{run.flags()}` | {run.step_time:.2f} | {predicted} | "
            f"{100 * error:+.1f}% | {f'{100 * held[i]:+.1f}%' if held else 'n/a'} |"
        )
    errors = [abs(e) for _, _, e in rows]
    loso = [abs(e) for e in held.values()]
    held_out = (
        f"each source's runs with the MoE constants ({', '.join(MOE_GRID)}) refitted without it: "
        f"mean {100 * sum(loso) / len(loso):.1f}%, max {100 * max(loso):.1f}%."
        if loso
        else "one source: no refit without it."
    )
    lines += [
        "",
        f"{len(rows)} runs from {len(sources)} source{'s' if len(sources) > 1 else ''}: step-time error mean "
        f"{100 * sum(errors) / len(errors):.1f}%, max {100 * max(errors):.1f}%; {held_out}",
        "",
        "Memory of each published layout under the planner's model (it must fit: the run happened):",
        "",
        "| model | ptdp plan flags | predicted total GiB | capacity GiB | fits |",
        "|---|---|---|---|---|",
    ]
    checks = memory_checks(runs)
    lines += [
        f"| {run.name} | `{run.flags()}` | {total:.1f} | {cap:.1f} | {'yes' if total <= cap else f'**no**, {total - cap:.1f} GiB over'} |"
        for run, total, cap in checks
    ]
    over = sum(not total <= cap for _, total, cap in checks)
    lines += ["", f"{over} of {len(checks)} published layouts predicted over their GPU's memory."]
    return "\n".join(lines)


def validation_markdown(csv: str | Path, pool: list[H100Run] | None = None) -> str:
    """The validation table with the in-sample and leave-one-source-out errors (the fits over this
    table's runs and ``pool``, the runs of the other H100-format tables given), and the memory check
    of every published layout, those predicted over their GPU's memory flagged."""
    if is_moe_table(csv):
        unread = unread_columns(csv)
        note = f"\n\nnote: columns not read (not among the table's): {', '.join(unread)}" if unread else ""
        return moe_validation_markdown(load_moe_runs(csv)) + note
    if is_h100_table(csv):
        runs, others = load_h100_runs(csv), pool or []
        held = loso_h100(others + runs)[len(others) :]
        table, checks = format_validation_table(validate_h100(runs), held), h100_fit_check(runs)
    else:
        published = load_published_runs(csv)
        table, checks = format_validation_table(validate(published), loso_a100(published)), fit_check(published)
    over = sum(total > cap for _, _, total, cap in checks)
    lines = [
        table,
        "",
        "Memory of each published layout under the planner's model (it must fit: the run happened):",
        "",
        "| model | layout | predicted total GiB | capacity GiB | fits |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {label} | {total:.1f} | {cap:.1f} | {'yes' if total <= cap else f'**no**, {total - cap:.1f} GiB over'} |"
        for name, label, total, cap in checks
    ]
    lines += ["", f"{over} of {len(checks)} published layouts predicted over their GPU's memory."]
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
        heading = "## Planner validation against published runs"
        text = (text.rstrip() + "\n\n" if text.strip() else "") + ("" if heading in text else heading + "\n\n")
        text += body + "\n"
    path.write_text(text, encoding="utf-8")


def pooled_markdown(runs: list[H100Run]) -> str:
    """Per metric, the errors over the runs of every H100-format table given, in-sample and
    leave-one-source-out."""
    table = format_validation_table(validate_h100(runs), loso_h100(runs))
    return "All H100-format tables together:\n\n" + table[table.index("| metric | rows") :]


#: ``ptdp plan`` settings that apply with ``--validate`` (each table row brings its own model,
#: layout and GPU)
VALIDATE_SETTINGS = ("validate", "update_benchmarks", "debug")


def check_validate_flags(args: argparse.Namespace) -> None:
    """ConfigError naming every ``ptdp plan`` flag given with ``--validate`` that it would ignore."""
    from ptdp.planner.inputs.plan_flags import add_plan_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_plan_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = [
        # the flag and its short alias, e.g. --tensor-model-parallel-size/--tp (not its --no- form)
        "/".join([o for o in action.option_strings if not o.startswith("--no-")][:2])
        for action in parser._actions
        if action.dest not in VALIDATE_SETTINGS
        and action.option_strings
        and getattr(args, action.dest, defaults.get(action.dest)) != defaults.get(action.dest)
    ]
    if given:
        raise ConfigError(
            f"--validate evaluates each table's runs at their own model, layout and GPU: "
            f"{', '.join(dict.fromkeys(given))} would be ignored (drop {'it' if len(given) == 1 else 'them'})"
        )


def run_validation(args: argparse.Namespace) -> int:
    check_validate_flags(args)
    paths = [Path(p) for p in args.validate]
    for csv in paths:
        if csv.is_dir():
            raise ConfigError(f"--validate {csv}: is a folder, not a CSV file")
        if not csv.is_file():
            raise ConfigError(f"--validate {csv}: no such file")
    resolved = [csv.resolve() for csv in paths]
    twice = sorted({str(csv) for csv, real in zip(paths, resolved) if resolved.count(real) > 1})
    if twice:
        raise ConfigError(f"--validate: a table given more than once: {', '.join(twice)}")
    if args.update_benchmarks:
        check_output_path(args.update_benchmarks, "--update-benchmarks", (".md",))
    h100: dict[Path, list[H100Run]] = {}
    for csv in paths:
        try:
            if is_moe_table(csv):
                count = len(load_moe_runs(csv))
            elif is_h100_table(csv):
                h100[csv] = load_h100_runs(csv)
                count = len(h100[csv])
            else:
                count = len(load_published_runs(csv))
        except (KeyError, ValueError, TypeError) as e:
            if isinstance(e, ValueError) and str(e).startswith(f"{csv}:"):  # a row's error, located
                raise ConfigError(f"--validate {e}") from None
            raise ConfigError(
                f"--validate {csv}: not a published-runs table like benchmarks/data/published_runs.csv "
                f"or published_runs_h100.csv ({type(e).__name__}: {e})"
            ) from None
        if not count:
            raise ConfigError(f"--validate {csv}: no runs in the table")
    blocks: list[tuple[Path | None, str]] = []
    for csv in paths:
        pool = [run for other, runs in h100.items() if other != csv for run in runs]
        try:
            blocks.append((csv, validation_markdown(csv, pool)))
        except ValueError as e:  # a MoE row whose flags ptdp plan refuses (ConfigError) or rules reject
            raise ConfigError(f"--validate {csv}: {e}") from None
    if len(h100) > 1:
        blocks.append((None, pooled_markdown([run for runs in h100.values() for run in runs])))
    command = f"ptdp plan --validate {' '.join(args.validate)} --update-benchmarks {args.update_benchmarks}"
    for table, block in blocks:
        print((f"## {table}\n\n" if len(blocks) > 1 and table else "") + block + "\n")
        if args.update_benchmarks:
            marks = markers(table) if table else POOLED
            update_markdown(Path(args.update_benchmarks), block, command, marks)
    if args.update_benchmarks:
        print(f"written into {args.update_benchmarks}")
    return 0
