"""Tensor parallelism: f/g operators, column/row-parallel linears, vocab-parallel embedding and loss,
and the sequence-parallel operators.

Names are imported on first use (PEP 562), so the pure arithmetic of :mod:`.vocab` can be used
(by the configuration rules and the planner) without importing torch.
"""
