"""Errors a user can cause; each message names the offending value and a fix."""


class PolyshardError(ValueError):
    """Bad input to polyshard: a strategy, mesh, cluster or flag that cannot work."""
