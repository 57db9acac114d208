"""Config files: ``--config FILE`` (TOML, YAML or JSON) and ``--print-config``.

Keys are the long flag names, with dashes or underscores, or the schema's field names
(``add_bias_linear = false`` is ``--disable-bias-linear``); sections may nest them and their names do
not matter. Command-line flags override the file. A run's own ``config.json`` replays that run: its
``requested_vocab_size`` is the tokenizer's vocabulary, and the fields a run records about itself
(``num_microbatches``, ``prepared_data``, ``output_dir``) and ``overwrite`` / ``force`` are skipped.
An unknown key is an error naming the key and the closest valid name.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from ptdp.config.flags import Setting, int_list, settings
from ptdp.errors import ConfigError

#: Keys a run's config.json records about itself, not settings.
RUN_RECORD_KEYS = {"num_microbatches", "prepared_data", "output_dir"}
#: Settings of a recorded run that a replay does not take over: permissions to overwrite a run
#: directory or to start despite the memory estimate are given on the command line, each time.
RUN_RECORD_SKIPPED = {"overwrite", "force"}


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a TOML (``.toml``), YAML (``.yaml``/``.yml``) or JSON (other) file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    try:
        if path.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # Python 3.10: the same parser, published as tomli (a dependency there)
                import tomli as tomllib

            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:
        raise ConfigError(f"--config {path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections merged into one mapping of keys (the last one wins)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[key] = (prefix, value)
    return out


def _lookup(allowed: list[Setting]) -> dict[str, Setting]:
    table = {}
    for s in allowed:
        for name in (s.flag.name, *s.flag.aliases, s.name):
            table[name.lstrip("-").replace("-", "_")] = s
    return table


def file_defaults(path: str | Path, allowed: list[Setting]) -> dict[str, Any]:
    """The parser defaults (by dest) that the config file at ``path`` sets for the ``allowed``
    settings (a command's flags; other settings of the schema are skipped); ConfigError for a key
    the schema does not know (naming the closest valid one) or a value of the wrong type."""
    data = read_file(path)
    record = "requested_vocab_size" in data or "prepared_data" in data
    table, mine = _lookup(list(settings())), {s.dest for s in allowed}
    out: dict[str, Any] = {}
    for key, (prefix, value) in _flatten({k: v for k, v in data.items() if k not in RUN_RECORD_KEYS}).items():
        if key in RUN_RECORD_KEYS:
            continue
        norm = key.replace("-", "_")
        if record and (norm == "vocab_size" or norm in RUN_RECORD_SKIPPED):
            continue  # the real vocabulary (requested_vocab_size is what the tokenizer was trained for)
        if record and norm == "requested_vocab_size":
            norm = "vocab_size"
        setting = table.get(norm)
        if setting is None:
            close = difflib.get_close_matches(norm, list(table), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0].replace('_', '-')!r}?" if close else ""
            raise ConfigError(f"--config {path}: unknown key '{prefix}{key}'{hint}")
        if setting.dest not in mine:
            continue  # a setting of another command (e.g. --lr in a file also used by ptdp plan)
        negated = setting.flag.negate and norm == setting.flag.name.lstrip("-").replace("-", "_")
        out[setting.dest] = _value(setting, value, f"{prefix}{key}", path, negated)
    return out


def _value(s: Setting, value: Any, key: str, path: str | Path, negated: bool) -> Any:
    where = f"--config {path}: {key}={value!r}"
    kind = s.kind
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        return not value if negated else value
    if value is None:
        return None
    if kind == "choice":
        if s.flag.none_choice and value == s.flag.none_choice:
            return None
        if value not in s.choices:
            raise ConfigError(f"{where} must be one of {s.choices}")
        return value
    if kind == "ints":
        return tuple(value) if isinstance(value, (list, tuple)) else int_list(str(value))
    if kind == "paths":
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    try:
        if s.scalar_type is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise ValueError
        return s.scalar_type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a {s.scalar_type.__name__}") from None


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--print-config``."""
    g = parser.add_argument_group("configuration file")
    g.add_argument(
        "--config",
        metavar="FILE",
        help="TOML, YAML or JSON file of settings (keys: the long flag names; "
        "a run's config.json replays that run); flags on the command line override it",
    )
    g.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (JSON, usable with --config) and exit",
    )


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """If ``argv`` names ``--config FILE``, make its settings the defaults of the flags ``parser``
    has (the command line, parsed afterwards, overrides them); ConfigError for a bad file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        allowed = [s for s in settings() if _has(parser, s)]
        parser.set_defaults(**file_defaults(known.config, allowed))


def _has(parser: argparse.ArgumentParser, s: Setting) -> bool:
    return any(s.flag.name in action.option_strings for action in parser._actions)
