"""Context parallelism: the sequence split over the ranks of the ``cp`` axis.

The pieces the model (:mod:`ptdp.engine.model.gpt`) uses when cp > 1: the load-balanced layout
of the sequence and the positions a rank holds (:mod:`.chunks`), causal attention block by block
merged by log-sum-exp (:mod:`.blockwise`), and attention across the cp ranks with an all-gather
or a ring of point-to-point transfers of keys and values (:mod:`.attention`, :mod:`.ring`), each
block computed by the explicit kernel or a fused flash-attention one (:mod:`.kernels`).

Names are imported on first use (PEP 562).
"""
