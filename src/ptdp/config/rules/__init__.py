"""The rules a request must satisfy, as pure functions returning :class:`Violation` objects.

``ptdp train`` (:func:`ptdp.config.resolve.resolve`) and the planner (:mod:`ptdp.planner.search.rules`)
call the same functions, so every layout the planner proposes can run; each violation carries a rule
id, the values it saw, and a message naming them. Sources: Narayanan et al. SC21, arXiv:2104.04473
(layout, schedules); Shoeybi et al., arXiv:1909.08053 (tensor parallelism); Korthikanti et al. 2022,
arXiv:2205.05198 (sequence parallelism, recompute). Among them:

- ``heads % tp == 0``, ``hidden % heads == 0``, ``ffn % tp == 0``; GQA: ``heads % G == 0``, ``G % tp == 0``
- ``num_layers % pp == 0`` unless an explicit split; ``global_batch_size % (micro_batch_size * dp) == 0``
- interleaved 1F1B: layers (plus counted edges) divide by ``pp * v``, ``pp >= 2``, ``m % pp == 0``
- sequence parallelism: ``tp > 1``, ``seq_length % tp == 0``; context parallelism:
  ``seq_length % (2 cp) == 0`` (and ``% (cp tp)`` with sequence parallelism)
- data-parallel sharding: one of no_shard, optim, optim_grads, optim_grads_params, consistent with
  ``use_distributed_optimizer``, ``overlap_param_gather`` and ``reshard_after_forward``
"""
