"""The engine layer: the parallel mechanics and the model, on torch.

Tensor, context, pipeline and data parallelism (``tensor_parallel/``, ``context_parallel/``,
``pipeline/``, ``data_parallel/``), the model (``model/``), the optimizers (``optim/``), the
process groups (``groups.py``), the collectives (``comm.py``), building a stage and running one
step (``step.py``), this process's phase record (``activity.py``) and hooks (``hooks.py``).
"""
