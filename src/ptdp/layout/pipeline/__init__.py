"""The pipeline as data: which rank and chunk runs each virtual stage (``placement.py``), the layer
partition over stages and virtual chunks (``partition.py``), when each compute runs for given
durations (``timing.py``), the schedules (``schedule.py``), each rank's program of compute and
point-to-point groups (``program.py``), NCCL's point-to-point rules as a model (``nccl_model.py``)
and the simulation that proves a program deadlock-free (``verify.py``). Pure: ``ptdp schedule``
runs without torch."""
