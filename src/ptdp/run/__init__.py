"""The run layer: everything around the engine that makes a training run.

Checks before any worker starts (``rundir.py``, ``paths.py``, ``memory_check.py``), the local
launcher (``launch.py``) and what it reports when a worker fails (``postmortem.py``, from the records of ``rank_records.py``), the worker
(``worker.py``: the entry of launched workers and of ``torchrun -m ptdp.train``), its start-up
(``distributed.py``), the loop (``trainer.py``), restarts (``restart.py``), metrics and traces
(``metrics.py``, ``trace.py``), checkpoints (``checkpoint/``), measuring the machine for the
planner (``calibration.py``; its fits are :mod:`ptdp.planner.time.profile_fit`) and the planner-vs-measured report (``planner_report.py``).
"""
