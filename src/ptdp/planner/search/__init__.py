"""The search: a request's checks (``request.py``), the rules a layout must keep (``rules.py``),
every layout of a cluster (``layouts.py``) and the prediction of each (``predict.py``)."""
