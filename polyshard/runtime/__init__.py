"""Runtime: what runs each step (gradient sync, eager sharded calls, the trainer)."""
