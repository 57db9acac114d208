"""The optimizer of a stage: torch's AdamW as ptdp steps it (``adamw.py``), the distributed
optimizer over sharded gradients or parameters (``zero.py``), and the one factory choosing between
them for every sharding strategy (``factory.py``)."""
