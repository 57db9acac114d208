"""What a plan is asked for: the GPU catalog and cluster (``hardware.py``), model presets
(``models.py``) and Hugging Face configs (``hf_config.py``, transformers' defaults in ``hf_defaults.py``), a node's measured links
(``node_links.py``), and the flags only ``ptdp plan`` has (``plan_flags.py``)."""
