"""The engine layer: the parallel mechanics and the model, on torch.

Tensor, context, pipeline and data parallelism (``tensor_parallel/``, ``context_parallel/``,
``pipeline/`` (the runtime of :mod:`ptdp.layout.pipeline`'s programs), ``data_parallel/``), the
GPT/Llama-like model (``model/``), the optimizers (``optim/``), the process groups
(``groups.py``) and the one module that calls ``torch.distributed`` collectives (``comm.py``),
building a stage and running one step (``step.py``), this process's phase record
(``activity.py``) and the hooks outside code may register on phases and steps (``hooks.py``).
It imports the layout and config layers, never the planner, the run layer or the commands.
"""
