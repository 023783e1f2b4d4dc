"""What a mapping table counts (`MappingStats`) and the wrapper that times its eviction policy
(`TimedPolicy`, a mapping built with ``profile=True``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .policy import EvictionPolicy


@dataclass
class MappingStats:
    lookups: int = 0        # unique entries asked for by ensure_resident
    hits: int = 0           # ... already on the device
    promotions: int = 0     # host -> device rows
    demotions: int = 0      # device -> host rows
    staged: int = 0         # promotions routed through staging (host full)
    deferred: int = 0       # host entries read but not promoted (``promote_after``)
    assigned: int = 0
    freed: int = 0
    lost: int = 0           # entries dropped because a copy_fn raised
    plans: int = 0          # non-empty move plans made
    policy_time_s: float = 0.0  # only accumulated with profile=True
    policy_time_by: dict = field(default_factory=dict)  # the same, per policy method

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class TimedPolicy(EvictionPolicy):
    """Wraps a policy and accumulates wall time of its calls into ``stats.policy_time_s``."""

    def __init__(self, inner: EvictionPolicy, stats: MappingStats):
        self.inner, self.stats, self.name = inner, stats, inner.name

    @property
    def victim_path(self) -> str:
        return self.inner.victim_path

    def _t(self, fn, *a):
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            dt = time.perf_counter() - t0
            st = self.stats
            st.policy_time_s += dt
            st.policy_time_by[fn.__name__] = st.policy_time_by.get(fn.__name__, 0.0) + dt

    def hit_touch(self, v):
        return self._t(self.inner.hit_touch, v)

    def touch(self, s):
        return self._t(self.inner.touch, s)

    def select_victims(self, k):
        return self._t(self.inner.select_victims, k)

    def release(self, s):
        return self._t(self.inner.release, s)

    def advance_round(self):
        return self._t(self.inner.advance_round)
