"""Planning: op rules, sharding propagation and the Plan. Pure: no torch.distributed."""
