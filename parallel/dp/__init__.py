"""Data parallelism (the dp axis): the bucketed gradient reduce, ZeRO-1 optimizer-state
sharding, and fully sharded data parallelism (FSDP2)."""
