"""Seconds of one step: FLOPs and GEMM speed (``flops.py``), collectives (``collectives.py``), the
context-parallel exchange (``cp_exchange.py``), each stage's microbatch (``stages.py``), the
data-parallel and optimizer terms (``data_parallel.py``), the step (``step_time.py``), its constants
(``constants.py``), a measured hardware profile (``profile.py``) and its fit from measurements
(``profile_fit.py``)."""
