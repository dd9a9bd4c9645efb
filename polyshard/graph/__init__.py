"""Capture: a module turned into an op graph with shapes and dtypes, using no real memory."""
