"""The rules a request must satisfy, as pure functions returning :class:`Violation` objects.

``ptdp train`` (:func:`ptdp.config.resolve.resolve`) and the planner (:mod:`ptdp.planner.search.rules`)
call the same functions, so every layout the planner proposes can run; each violation carries a
rule id the planner groups by, the values it saw, and a message naming them.

Sources: Narayanan et al. SC21, arXiv:2104.04473 (layout, schedules); Shoeybi et al.,
arXiv:1909.08053 (tensor parallelism); Korthikanti et al. 2022, arXiv:2205.05198 (sequence
parallelism, recompute). By concept: the model's shape and options (``shape.py``), the layout,
batch and pipeline schedule (``layout.py``), sequence and context parallelism (``axes.py``), the
data-parallel sharding and engine (``dp_sharding.py``), training, profiling, checkpoints and launch
(``run_options.py``), sizes and numbers (``values.py``).

- ``heads % tp == 0`` (attention is split by heads), ``hidden % heads == 0``, ``ffn % tp == 0``
- ``num_layers % pp == 0`` unless an explicit ``pipeline_layer_split`` (pp entries >= 1 summing
  to ``num_layers``) or first/last stage counts (``decoder_first/last_pipeline_num_layers``: the
  other stages split the rest evenly; not with ``pipeline_layer_split`` nor interleaving)
- ``global_batch_size % (micro_batch_size * dp) == 0``
- interleaved 1F1B: ``(num_layers + counted) % (pp * layers_per_chunk) == 0`` or ``% (pp * v)``
  (both given: the same v), ``pp >= 2``, ``m % pp == 0``
- grouped-query attention: ``heads % G == 0`` and ``G % tp == 0``; rotary needs an even head dim
- sequence parallelism: ``tp > 1`` and ``seq_length % tp == 0``
- recompute: method and count need ``full``; ``1 <= recompute_num_layers <=`` layers per chunk
- context parallelism: ``cp >= 1`` and ``seq_length % (2 cp) == 0`` (each cp rank holds two of
  the ``2 cp`` load-balanced causal chunks); the head rules do not involve cp; with cp > 1 and
  sequence parallelism ``seq_length % (cp tp) == 0``
- data-parallel sharding: one of no_shard, optim, optim_grads, optim_grads_params, not
  contradicting ``use_distributed_optimizer`` (which means optim); optim_grads_params without
  ``overlap_param_gather``; ``reshard_after_forward=False`` only with optim_grads_params
"""
