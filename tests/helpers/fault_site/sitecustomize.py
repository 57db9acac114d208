"""Installs the fault plan of the environment (``helpers.faults``) in every Python process started
with this folder on ``PYTHONPATH`` (``helpers.faults.environment``)."""

from helpers.faults import install_from_env

install_from_env()
