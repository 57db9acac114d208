"""Errors of a request and of its data, and one broken rule as data.

A :class:`Violation` is what a rule of :mod:`ptdp.config.rules` returns: a short rule id (for
grouping, e.g. in ``ptdp plan``'s rejection summary), the values involved and the message that
names them. :class:`ConfigError` carries the violations of a whole request at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``rule`` id (e.g. ``"heads % tp"``), the ``values`` it saw, the message."""

    rule: str
    message: str
    values: dict = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        return self.message


def V(rule: str, message: str, **values) -> Violation:
    """A :class:`Violation` of ``rule`` with its ``message`` and the ``values`` it saw."""
    return Violation(rule, message, values)


class ConfigError(ValueError):
    """An invalid configuration; the message names every broken rule and the values involved.
    ``violations`` holds them as data when they came from the rules."""

    def __init__(self, message: str, violations: tuple[Violation, ...] = ()) -> None:
        super().__init__(message)
        self.violations = tuple(violations)


def raise_violations(violations: list[Violation]) -> None:
    """Raise one :class:`ConfigError` listing every violation, if there is any."""
    if violations:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(v.message for v in violations), tuple(violations))


class DataError(ValueError):
    """Bad or unusable training data: a missing path, an empty corpus, a corrupt token file, a
    sequence length longer than the corpus, ... The message names the offending values."""
