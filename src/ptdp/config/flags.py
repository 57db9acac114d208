"""The command-line flags of ``ptdp train``, ``python -m ptdp.train`` and ``ptdp plan``, built from
the schema's fields (:class:`~ptdp.config.fields.Flag`), and the config they give back.

Every flag's name, aliases, type, choices and help come from one field, so the commands share them:
a boolean field gets ``--x/--no-x``, a ``Literal`` its choices (plus ``none`` where that means
unset), a tuple of ints a comma list. For ``ptdp train`` the default is the field's (or the
command's own, ``cli_default``: tp = pp = 2); for ``ptdp plan`` every shared flag defaults to None,
meaning "search this choice" or "take the model preset's value".
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from collections.abc import Iterator
from typing import Any, Literal

from ptdp.config.fields import GROUPS, UNSET, Flag
from ptdp.config.schema import SECTIONS, Config

Command = Literal["train", "torchrun", "plan"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of the schema: its section (None: a field of :class:`Config` itself), name, type
    and :class:`Flag`."""

    section: str | None
    name: str
    type: Any
    default: Any
    flag: Flag

    @property
    def dest(self) -> str:
        return self.name

    @property
    def kind(self) -> str:
        """``bool``, ``choice``, ``ints`` (a tuple of ints), ``paths`` (a tuple of str) or ``scalar``."""
        base = _without_none(self.type)
        if base is bool:
            return "bool"
        if typing.get_origin(base) is Literal:
            return "choice"
        if typing.get_origin(base) is tuple:
            return "ints" if typing.get_args(base)[0] is int else "paths"
        return "scalar"

    @property
    def scalar_type(self) -> type:
        return _without_none(self.type)

    @property
    def choices(self) -> tuple[str, ...]:
        return typing.get_args(_without_none(self.type)) if self.kind == "choice" else ()


def _without_none(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


def settings() -> Iterator[Setting]:
    """Every field of the schema that has a flag, sections first, in declaration order."""
    for section, cls in [*SECTIONS.items(), (None, Config)]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get("flag")
            if flag is not None:
                if f.default is not dataclasses.MISSING:
                    default = f.default
                elif f.default_factory is not dataclasses.MISSING:
                    default = f.default_factory()
                else:
                    raise TypeError(f"{cls.__name__}.{f.name} has a flag but no default")
                yield Setting(section, f.name, hints[f.name], default, flag)


def int_list(text: str) -> tuple[int, ...]:
    """``3,3,2`` -> ``(3, 3, 2)``; Megatron's list form too: ``[0]*2+[1]*3`` -> ``(0, 0, 1, 1, 1)``,
    ``[1,0]`` -> ``(1, 0)``."""
    compact = text.replace(" ", "")
    try:
        if "[" not in compact:
            return tuple(int(x) for x in compact.split(","))
        out: list[int] = []
        for term in compact.split("+"):
            body, star, times = term.partition("*")
            if not (body.startswith("[") and body.endswith("]")):
                raise ValueError(term)
            items = [int(x) for x in body[1:-1].split(",")] if body != "[]" else []
            out.extend(items * (int(times) if star else 1))
        return tuple(out)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers or a list like [0]*3+[1]*5, got {text!r}"
        ) from None


def add_flags(parser: argparse.ArgumentParser, command: Command, defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of ``command`` to ``parser``: every field for ``train`` (``torchrun``: without
    the local launcher's), the ``plan=True`` ones for ``plan`` (default None). ``defaults``
    overrides the defaults by dest (e.g. the CPU timeout)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings():
        if (command == "plan" and not s.flag.plan) or (command == "torchrun" and s.flag.local):
            continue
        if command != "plan" and not s.flag.train:
            continue
        if s.flag.group not in groups:
            groups[s.flag.group] = parser.add_argument_group(GROUPS[s.flag.group])
        _add(groups[s.flag.group], s, command, (defaults or {}).get(s.dest, _default(s, command)))


def add_named_flags(
    parser: argparse.ArgumentParser, names: dict[str, Any], helps: dict[str, str] | None = None
) -> None:
    """Add the flags of the schema fields named in ``names`` (field name -> default), as ``ptdp
    train`` spells them (same names, aliases, types and choices), with ``helps`` replacing the
    help of some: for commands that take a few of the schema's settings, e.g. ``ptdp schedule``."""
    found = {s.name: s for s in settings() if s.name in names}
    missing = set(names) - set(found)
    if missing:
        raise KeyError(f"no schema field with a flag named {sorted(missing)}")
    for name, default in names.items():
        s = found[name]
        if helps and name in helps:
            s = dataclasses.replace(s, flag=dataclasses.replace(s.flag, help=helps[name]))
        _add(parser, s, "train", default)


def _default(s: Setting, command: Command) -> Any:
    if command == "plan":
        return None
    return s.flag.cli_default if s.flag.cli_default is not UNSET else s.default


def _add(group, s: Setting, command: Command, default: Any) -> None:
    f = dataclasses.replace(s.flag, help=s.flag.help.replace("%", "%%"))  # argparse formats help with %
    names = [f.name, *f.aliases]
    if s.kind == "bool" and f.negate:  # ptdp plan: None unless given (a preset's value stands)
        unset = None if command == "plan" else True
        group.add_argument(
            *names, dest=s.dest, action="store_false", default=default if default is not None else unset, help=f.help
        )
        return
    if s.kind == "bool" and f.name.startswith("--no-"):  # a switch that is itself a negation
        group.add_argument(*names, dest=s.dest, action="store_true", default=default, help=f.help)
        return
    if s.kind == "bool":
        searched = command == "plan" and s.section in ("parallel", "train") or s.name == "recompute_granularity"
        searched = searched and f.plan_searched
        group.add_argument(
            *names,
            dest=s.dest,
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f.help + (" (default: search both)" if command == "plan" and searched else ""),
        )
        return
    kwargs: dict[str, Any] = {"dest": s.dest, "default": default, "help": f.help, "metavar": f.metavar}
    if s.kind == "choice":
        kwargs["choices"] = s.choices + ((f.none_choice,) if f.none_choice else ())
        kwargs["type"] = str
        if f.none_choice and command != "plan":  # train: the none choice means unset (plan: None
            kwargs["action"] = _none_choice(f.none_choice)  # means "search", so it keeps the word)
        kwargs.pop("metavar")
    elif s.kind == "ints":
        kwargs["type"] = int_list
    elif s.kind == "paths":
        kwargs["action"] = _AppendReplacing
    else:
        kwargs["type"] = s.scalar_type
    if f.shortcuts and "action" not in kwargs:  # --params-dtype X and --bf16/--fp16/--fp32: one answer
        kwargs["action"] = _OneAnswer
    group.add_argument(*names, **kwargs)
    for name, value, text in f.shortcuts:
        group.add_argument(name, dest=s.dest, action=_OneAnswer, nargs=0, const=value, help=text)


class _OneAnswer(argparse.Action):
    """Store a value (or, with ``nargs=0``, the ``const`` of a shortcut such as ``--bf16``) unless
    another option of the same setting already asked for a different one: ``--bf16 --fp16`` is an
    error naming both, not "the last one wins"."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        given = namespace.__dict__.setdefault("_ptdp_given", {})
        earlier = given.get(self.dest)
        if earlier is not None and earlier[1] != value:
            parser.error(
                f"{earlier[0]} and {option_string} ask for different {self.dest.replace('_', ' ')} "
                f"({earlier[1]} and {value}): give one"
            )
        given[self.dest] = (option_string, value)
        setattr(namespace, self.dest, value)


class _AppendReplacing(argparse.Action):
    """``append``, except that the first use on the command line replaces the default (a list
    from a config file) instead of adding to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        mark = f"_replaced_{self.dest}"
        current = list(getattr(namespace, self.dest) or ()) if getattr(namespace, mark, False) else []
        setattr(namespace, mark, True)
        setattr(namespace, self.dest, [*current, values])


def _none_choice(word: str) -> type[argparse.Action]:
    """A store action that keeps None for ``word`` (checked against the choices first)."""

    class StoreNoneChoice(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            setattr(namespace, self.dest, None if values == word else values)

    return StoreNoneChoice


def config_from_args(args: argparse.Namespace) -> Config:
    """The (not yet resolved) :class:`Config` the parsed flags describe."""
    values: dict[str | None, dict[str, Any]] = {section: {} for section in [*SECTIONS, None]}
    for s in settings():
        if not hasattr(args, s.dest):
            continue
        value = getattr(args, s.dest)
        if s.kind == "paths":
            value = tuple(value or ())
        values[s.section][s.dest] = value
    sections = {name: cls(**values[name]) for name, cls in SECTIONS.items()}
    return Config(**sections, **values[None])


class Parser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are a few lines, not the usage: the error,
    the closest flags for an unknown or ambiguous one, and where ``--help`` is; exit code 2.
    Abbreviated flags are refused (``allow_abbrev=False``, as Megatron-LM's parser)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n  (see `{self.prog} --help`)\n")


def closest_flags(flag: str, known: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` flags of ``known`` closest to the unknown ``flag``: those it begins, then
    difflib's closest."""
    starts = sorted((k for k in known if k.startswith(flag) and len(flag) > 2), key=len)
    close = difflib.get_close_matches(flag, known, n=n, cutoff=0.6)
    return list(dict.fromkeys([*starts, *close]))[:n]


def reject_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit 2 through ``parser`` naming the unrecognized arguments ``extra`` and, for each unknown
    flag, the closest flags ``parser`` knows."""
    known = [opt for action in parser._actions for opt in action.option_strings]
    hints = []
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-") and flag not in known:
            close = closest_flags(flag, known)
            if close:
                hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    parser.error(f"unrecognized arguments: {' '.join(extra)}" + "".join(f"\n  {h}" for h in hints))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` whose unknown flags get the closest known ones (:func:`reject_unknown`)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        reject_unknown(parser, extra)
    return args
