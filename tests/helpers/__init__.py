"""What the tests of every tier (tests/unit, tests/dist, tests/e2e) share, imported as
``from helpers import budget`` or ``from helpers.layout_cases import ...`` (``tests`` is on
``sys.path``: pytest's ``pythonpath`` in pyproject.toml).

- :mod:`helpers.budget`: each test's time budget; inner timeouts end before the test's own.
- :mod:`helpers.dist_helpers`: a function run in N gloo worker processes spawned from pytest: new
  ones, or the workers kept for the session (one world per size).
- :mod:`helpers.proc_helpers`: commands (launchers and their workers) run with a hard timeout.
- :mod:`helpers.cli`: the tiny model's ``ptdp train`` flags (defined once), the text corpora, a
  command runner for end-to-end tests.
- :mod:`helpers.layout_cases`: a tiny GPT trained a few steps at a layout (one job per layout,
  cached), the single-process reference, and the comparison of parameters across ranks.
- :mod:`helpers.activations`, :mod:`helpers.dropout_cases`, :mod:`helpers.recompute_cases`,
  :mod:`helpers.tp_cases`, :mod:`helpers.checkpoints`, :mod:`helpers.hf_helpers`,
  :mod:`helpers.hf_llama`, :mod:`helpers.texts`: the cases and references a unit test and a
  several-process test of the same feature both use.
"""
