"""Sizes must be positive integers and numbers finite."""

from __future__ import annotations

import math

from ptdp.errors import V, Violation


def positive_violations(values: dict[str, object]) -> list[Violation]:
    """Each value must be a positive integer."""
    return [
        V("positive", f"{name}={value!r} must be a positive integer", **{name: value})
        for name, value in values.items()
        if not isinstance(value, int) or isinstance(value, bool) or value < 1
    ]


def finite_violations(values: dict[str, object]) -> list[Violation]:
    """Each value must be a finite number (nan or inf would train silently wrong)."""
    return [
        V("finite", f"{name}={value!r} must be a finite number")
        for name, value in values.items()
        if not isinstance(value, (int, float)) or not math.isfinite(value)
    ]
