"""The planner's one error type, at the bottom of its modules (nothing here imports them)."""
from __future__ import annotations


class PlannerError(ValueError):
    """A bad planner input; the message names the fix."""
