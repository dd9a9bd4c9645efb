"""Per-op sharding rules: given the layouts an op's inputs arrive in, the layouts it needs and gives."""

from polyshard.planner.rules.base import RuleContext
from polyshard.planner.rules.table import decide, decide_all, left_whole, row_splits

__all__ = ["RuleContext", "decide", "decide_all", "left_whole", "row_splits"]
