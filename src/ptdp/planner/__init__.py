"""The parallelism planner: memory, compute, communication and bubble models; layout search.

Pure functions, no processes. Formulas cite Narayanan et al. SC21 (arXiv:2104.04473) and
Korthikanti et al. 2022 (arXiv:2205.05198).
"""
