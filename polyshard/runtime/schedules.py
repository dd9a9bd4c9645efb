"""Pipeline schedules as the runtime runs them: defined in :mod:`polyshard.planner.schedules`, whose
simulation the planner costs schedules by, so both sides follow one definition."""

from polyshard.planner.schedules import Action, ActionTime, check_schedule, schedule_actions, simulate

__all__ = ["Action", "ActionTime", "check_schedule", "schedule_actions", "simulate"]
