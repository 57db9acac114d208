"""The commands: ``ptdp train`` (its flags in :mod:`ptdp.config.train_flags`), ``plan`` (with ``--validate`` and
``--calibrate``), ``topo``, ``generate`` and ``convert``. :mod:`ptdp.cli` only dispatches to them;
each imports torch only if it needs it (``ptdp plan`` and ``ptdp topo`` do not).
"""
