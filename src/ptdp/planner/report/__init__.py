"""What ``ptdp plan`` prints: text, JSON and plot (``render.py``) and why the pick beats the
runner-up (``explain.py``)."""
