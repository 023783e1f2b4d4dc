"""Promotion admission of one mapping table (``promote_after`` = k; `mapping` module doc): a
settle promotes a host entry only when it was read from the host in k settles in a row, this
one included. Keeps, per entry, the number of the settle it was last read from the host in
(k > 1) and in how many settles in a row (k > 2); freeing an entry forgets its reads."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ulacache_vllm import kernels as K


class PromotionAdmission:
    def __init__(self, promote_after: int, num_entries: int, device: torch.device):
        self.promote_after = promote_after
        self.settles = 0  # settles counted so far
        if promote_after > 1:
            self.last_read = torch.full((num_entries,), -2, dtype=torch.int64, device=device)
        if promote_after > 2:
            self.streak = torch.zeros((num_entries,), dtype=torch.int32, device=device)

    def admit(self, miss: torch.Tensor, miss_lv: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """Which of this settle's host entries ``miss`` (unique; ``miss_lv`` their table
        values) to promote: with k > 1, those read from the host in k settles in a row, this
        one included. Returns ``(entries, their table values, commit)``; ``commit()`` records
        this settle's reads, called once the settle can no longer fail (a failed call changes
        nothing)."""
        k = self.promote_after
        if k == 1:
            return miss, miss_lv, self.count_settle
        run = self.last_read.index_select(0, miss) == self.settles - 1
        streak = None
        if k > 2:
            streak = torch.where(run, self.streak.index_select(0, miss) + 1,
                                 torch.ones_like(miss, dtype=torch.int32))
            run = streak >= k

        def commit():
            if streak is not None:
                self.streak.index_copy_(0, miss, streak)
            self.last_read.index_fill_(0, miss, self.settles)
            self.count_settle()

        return K.compact(miss, run), K.compact(miss_lv, run), commit

    def count_settle(self) -> None:
        self.settles += 1

    def forget(self, entries: torch.Tensor) -> None:
        """Freed (unique) entries: a reused address starts with no reads."""
        if self.promote_after > 1:
            K.reference.fill_at(self.last_read, entries, -2)
