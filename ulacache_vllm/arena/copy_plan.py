"""Copy plans: the byte moves a compaction or relayout needs, for the worker to execute.

A plan is a list of steps run in order; each step is an ``(k, 3)`` int64 array of
``(src_offset, dst_offset, nbytes)`` rows whose ranges never overlap one another (no copy in a
step reads bytes another copy of the same step writes), so a step can run as one batched
gather/scatter. Plans returned by successive arena calls must be executed in the order they
were returned and before any forward pass that uses pages placed by those calls.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros((0, 3), dtype=np.int64)


class CopyPlan:
    def __init__(self, steps: list[np.ndarray] | None = None) -> None:
        self.steps: list[np.ndarray] = [s for s in (steps or []) if len(s)]

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __len__(self) -> int:
        return sum(len(s) for s in self.steps)

    @property
    def copies(self) -> np.ndarray:
        return np.concatenate(self.steps) if self.steps else _EMPTY

    @property
    def nbytes(self) -> int:
        return int(sum(int(s[:, 2].sum()) for s in self.steps))

    def extend(self, other: "CopyPlan") -> "CopyPlan":
        self.steps.extend(other.steps)
        return self

    def add_step(self, copies) -> None:
        arr = np.asarray(copies, dtype=np.int64).reshape(-1, 3)
        if len(arr):
            self.steps.append(arr)

    def apply(self, buf) -> None:
        """Reference executor on a 1-D uint8 ``torch.Tensor`` or numpy array (tests, CPU)."""
        for step in self.steps:
            # Read every source of the step before writing, as a batched kernel would.
            chunks = [buf[s:s + n].clone() if hasattr(buf, "clone") else buf[s:s + n].copy()
                      for s, _, n in step.tolist()]
            for (_, d, n), c in zip(step.tolist(), chunks):
                buf[d:d + n] = c


def check_step(step: np.ndarray) -> bool:
    """True if no two ranges of a step (sources and destinations) overlap, except source-source."""
    ranges = [(int(d), int(d + n), "d") for _, d, n in step] + [
        (int(s), int(s + n), "s") for s, _, n in step]
    ranges.sort()
    end_d = end_s = -1
    for a, b, k in ranges:
        if a < end_d or (k == "d" and a < end_s):
            return False
        if k == "d":
            end_d = max(end_d, b)
        else:
            end_s = max(end_s, b)
    return True
