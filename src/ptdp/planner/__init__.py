"""The planner: the cost model of a parallel layout over the config types, without torch.

``inputs/`` (cluster, models, plan flags) -> ``memory/`` and ``time/`` (bytes and seconds of one
candidate, :mod:`ptdp.planner.candidate`) -> ``search/`` (rules, every layout, prediction) ->
``report/`` (text, JSON, plot, why); ``validate/`` holds the published runs. Formulas cite
Narayanan et al. SC21 (arXiv:2104.04473) and Korthikanti et al. 2022 (arXiv:2205.05198).
"""
