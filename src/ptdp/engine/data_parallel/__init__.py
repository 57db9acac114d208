"""Data parallelism: gradient buffer, data-parallel reduction, tied-embedding sum, norm and clipping."""
