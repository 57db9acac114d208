"""The rules of the FP8 options: ``--fp8-margin >= 0`` and ``--fp8-amax-history-len >= 1``,
integers; every other FP8 option needs ``--fp8-format`` (without it no GEMM runs in FP8)."""

from __future__ import annotations

from ptdp.config.fp8 import FP8Config
from ptdp.errors import V, Violation

_DEFAULTS = FP8Config()


def fp8_violations(fp8: FP8Config) -> list[Violation]:
    """Every broken FP8 rule (module docstring), each naming its value."""
    out: list[Violation] = []
    for name, least in (("fp8_margin", 0), ("fp8_amax_history_len", 1)):
        value = getattr(fp8, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            out.append(V("option", f"{name}={value!r} must be an integer >= {least}", **{name: value}))
    if not fp8.enabled:
        given = [
            f"{name}={getattr(fp8, name)!r}"
            for name in FP8Config.__dataclass_fields__
            if name != "fp8_format" and getattr(fp8, name) != getattr(_DEFAULTS, name)
        ]
        if given:
            out.append(
                V(
                    "option",
                    f"{', '.join(given)} without --fp8-format: no GEMM runs in FP8 (give --fp8-format e4m3 or hybrid)",
                )
            )
    return out
