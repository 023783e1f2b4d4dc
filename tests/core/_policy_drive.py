"""Shared test helper: run one victim selection on several policies side by side."""

import torch

from ulacache_vllm.core.pools import CapacityError


def select_all(policies, k):
    """``select_victims(k)`` on each policy; ``None`` where it raised ``CapacityError``.
    Asserts they agree on whether it raised and, where not, on the victims (in order)."""
    res = []
    for p in policies:
        try:
            res.append(p.select_victims(k))
        except CapacityError:
            res.append(None)
    first = res[0]
    for r in res:
        assert r is None or r.dtype == torch.int64  # slots leave every policy as int64
    for r in res[1:]:
        assert (r is None) == (first is None)
        if first is not None:
            assert r.tolist() == first.tolist()
    return first
