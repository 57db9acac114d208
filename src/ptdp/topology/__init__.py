"""Node topology (GPUs, links, NUMA nodes, CPUs), rank placement and CPU binding."""
