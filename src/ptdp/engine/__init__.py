"""The engine layer: the parallel mechanics and the model.

Tensor, context, pipeline and data parallelism (``tensor_parallel/``, ``context_parallel/``,
``pipeline/``, ``data_parallel/``), the GPT/Llama-like model (``model/``), the process groups (``groups.py``) and the one module that
calls ``torch.distributed`` collectives (``comm.py``), building a stage and running one step
(``step.py``), the optimizers (``optim.py``), and this process's phase record (``activity.py``,
with its test-only fault hooks in ``faults.py``). It imports the spec layer, never the run layer
or the commands.
"""
