"""The planner against published runs: the tables (``published.py``) and the comparison and fit
of the fitted constants (``accuracy.py``)."""
