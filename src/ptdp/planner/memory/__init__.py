"""Bytes on one GPU: parameters per stage and their state under each sharding strategy
(``params.py``, ``strategies.py``, ``transients.py`` over ``chunk_params.py``), activations
(``activations.py``, with context parallelism's ``cp_local.py``), FP8 weight copies (``fp8.py``),
and the most loaded GPU (``breakdown.py``)."""
