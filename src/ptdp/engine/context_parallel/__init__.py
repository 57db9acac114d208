"""Context parallelism: the sequence split over the ranks of the ``cp`` axis.

The load-balanced layout of the sequence (:mod:`.load_balance`), causal attention block by block
merged by log-sum-exp (:mod:`.blockwise`), and attention across the cp ranks with an all-gather or
a ring of point-to-point transfers of keys and values (:mod:`.cp_attention`, :mod:`.ring`), each
block computed by the explicit kernel or a fused flash-attention one (:mod:`.kernels`).
Names are imported on first use (PEP 562).
"""
