"""Pipeline parallelism (the pp axis): schedules as data, their validation and simulation,
the partition of blocks into stages, and the executor that walks a rank's action list."""
