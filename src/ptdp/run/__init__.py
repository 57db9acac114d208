"""The run layer: everything around the engine that makes a training run.

Pre-start checks (``rundir``, ``paths``, ``memory_check``, ``preflight``), the local launcher
(``launch``) and its failure report (``postmortem``, ``rank_records``), the worker (``worker``,
``distributed``, ``trainer``, ``restart``), metrics and traces (``metrics``, ``trace``),
checkpoints (``checkpoint/``), machine calibration for the planner (``calibration``) and the
planner-vs-measured report (``planner_report``).
"""
