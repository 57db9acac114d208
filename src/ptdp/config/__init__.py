"""The config layer: what a run is (the schema, its command-line flags, config files and Python
keywords), the rules it must satisfy, and ``resolve``. Pure: imports no torch; it stands on
:mod:`ptdp.layout` and is imported by the engine, the planner and everything above them.
"""
