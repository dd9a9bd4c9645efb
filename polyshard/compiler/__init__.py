"""Lowering: layouts to collectives, plans to per-rank modules."""
