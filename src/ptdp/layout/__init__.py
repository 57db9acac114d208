"""The pure arithmetic of a parallel layout, shared by the config rules, the planner and the engine:
the rank grid (``grid.py``), the pipeline's layer partition, schedules, programs and their proof
(``pipeline/``), vocabulary padding (``vocab.py``), gradient buckets (``buckets.py``), codec choice
(``codecs.py``) and the learning-rate schedule (``lr_schedule.py``). Imports no torch and nothing
above it (only :mod:`ptdp.errors`)."""
