"""Pipeline parallelism: layer partition, schedules as data, and the runtime that executes them."""
