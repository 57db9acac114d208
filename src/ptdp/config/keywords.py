"""Python keyword arguments as command-line flags: how :func:`ptdp.plan` and
:func:`ptdp.load_config` share the command line's parser, so types, choices and rules are checked
once, the same way.

A keyword is a flag's long name with ``_`` for ``-`` (``global_batch_size``), its destination
(``tensor_model_parallel_size``) or a short alias (``tp``, ``mbs``). ``True`` / ``False`` give
``--flag`` / ``--no-flag``, a list or tuple a comma list (the flag repeated for ``--data``), None leaves the flag out.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

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


def keywords_to_argv(options: dict[str, Any], names: dict[str, argparse.Action], *, caller: str) -> list[str]:
    """The command line that says what ``options`` say. Raises TypeError for an unknown keyword
    (naming the known ones) and ConfigError for ``False`` given to a switch with no negative form."""
    argv: list[str] = []
    for key, value in options.items():
        if key not in names:
            raise TypeError(f"{caller}() got an unexpected keyword argument {key!r}; known: {', '.join(sorted(names))}")
        if value is None:
            continue
        action = names[key]
        option = next(o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-"))
        if isinstance(value, bool):
            negative = [o for o in action.option_strings if o.startswith("--no-")]
            if value:
                argv.append(option)
            elif negative:
                argv.append(negative[0])
            elif not (action.nargs == 0 and action.const is True):  # False for a store_true: left off
                raise ConfigError(f"{key}=False: {option} has no negative form; leave it out")
        elif isinstance(value, (list, tuple)) and type(action).__name__ == "_AppendReplacing":
            for item in value:  # a flag given once per value (--data A --data B)
                argv += [option, str(item)]
        elif isinstance(value, (list, tuple)):
            argv += [option, ",".join(str(v) for v in value)]
        else:
            argv += [option, str(value)]
    return argv
