"""Seconds of one step: FLOPs and GEMM speed (``flops.py``), collectives (``collectives.py``), the
context-parallel exchange (``cp_exchange.py``), each stage's microbatch (``stages.py``), the
data-parallel and optimizer terms (``data_parallel.py``), the step (``step.py``), its constants
(``constants.py``) and a measured hardware profile (``profile.py``)."""
