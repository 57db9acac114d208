"""Python keyword arguments as the values of a command's flags: how :func:`ptdp.plan` and
:func:`ptdp.load_config` take the same settings as the command line, with the same types and
choices, without building a command line.

A keyword is a flag's long name with ``_`` for ``-`` (``global_batch_size``), its destination
(``tensor_model_parallel_size``) or a short alias (``tp``, ``mbs``). ``True`` / ``False`` give a
switch or its ``--no-`` form, a list or tuple a list value (``pipeline_layer_split=[3, 5]``,
``data=["a.txt", "b"]``), None leaves the flag out.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from ptdp.config.flags import int_list
from ptdp.errors import ConfigError


class RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise :class:`ConfigError` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def keyword_actions(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> dict[str, argparse.Action]:
    """Keyword -> the parser's action: every destination and every positive long option with
    ``_`` for ``-``; destinations in ``skip`` are left out."""
    names: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in skip or action.dest == "help":
            continue
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-"):
                names.setdefault(option[2:].replace("-", "_"), action)
        names.setdefault(action.dest, action)
    return names


def keyword_namespace(
    parser: argparse.ArgumentParser, options: dict[str, Any], *, skip: tuple[str, ...] = (), caller: str
) -> argparse.Namespace:
    """What ``parser`` gives for ``options``: its defaults, then each keyword's value checked
    against its flag's type and choices and stored by the flag's own action.

    Raises:
        TypeError: an unknown keyword (naming the known ones), or two naming the same flag.
        ConfigError: a value of the wrong type or not among the choices, or False for a switch
            with no negative form (naming the flag).
    """
    names = keyword_actions(parser, skip)
    namespace = parser.parse_args([])
    given: dict[str, str] = {}  # a flag's destination -> the keyword that set it
    for key, value in options.items():
        if key not in names:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}; known: {', '.join(sorted(names))}")
        if value is None:
            continue
        action = names[key]
        if action.dest in given:
            raise TypeError(f"{caller}() got {given[action.dest]!r} and {key!r}, two names of one option: give one")
        given[action.dest] = key
        option = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if action.nargs == 0:  # a switch
            _switch(parser, namespace, action, option, key, value)
        elif action.nargs in ("+", "*"):  # one flag taking the values
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            action(parser, namespace, [_checked(action, option, item) for item in items], option)
        elif isinstance(value, (list, tuple)) and action.type is None:  # a flag given once per value
            for item in value:
                action(parser, namespace, _checked(action, option, item), option)
        else:
            action(parser, namespace, _checked(action, option, value), option)
    return namespace


def _switch(parser, namespace, action: argparse.Action, option: str, key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"argument {option}: a switch: give True or False, not {value!r}")
    negative = [o for o in action.option_strings if o.startswith("--no-")]
    if value:
        action(parser, namespace, None, option)
    elif negative:
        action(parser, namespace, None, negative[0])
    elif action.const is not True:  # False for a store_true is its default
        raise ConfigError(f"{key}=False: {option} has no negative form; leave it out")


def _checked(action: argparse.Action, option: str, value: Any) -> Any:
    """``value`` as the flag's type would read it (text as on the command line), and among its
    choices."""
    kind = action.type
    if isinstance(value, str) and kind in (int, float, int_list):
        try:
            value = kind(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"argument {option}: invalid value {value!r} ({_expected(kind)})") from None
    if kind is int_list:
        if isinstance(value, int) and not isinstance(value, bool):  # one number, as the flag's N form
            value = (value,)
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        value = tuple(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:  # str, or a flag without a type: text or a path
        ok = isinstance(value, str) or (kind is None and hasattr(value, "__fspath__"))
        value = str(value) if ok else value
    if not ok:
        raise ConfigError(f"argument {option}: invalid value {value!r} ({_expected(kind)})")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ConfigError(f"argument {option}: invalid choice: {value!r} (choose from {choices})")
    return value


def _expected(kind: Any) -> str:
    if kind is int_list:
        return "a list of integers"
    if kind in (int, float):
        return f"expected {'an integer' if kind is int else 'a number'}"
    return "expected text"
