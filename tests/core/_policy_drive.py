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


def touch_new(policies, tracked, g, most=8):
    """Touch up to ``most - 1`` random untracked slots on every policy; mark them tracked."""
    free = (~tracked).nonzero().squeeze(1)
    new = free[torch.randperm(free.numel(), generator=g)[: int(torch.randint(0, most, (1,), generator=g))]]
    for p in policies:
        p.touch(new)
    tracked[new] = True


def hit_some(policies, tracked, g, n=10):
    """``hit_touch`` of up to ``n`` random tracked slots plus an unmapped (-1) and a host value
    on every policy; asserts they agree and returns the hit mask."""
    live = tracked.nonzero().squeeze(1)
    vals = torch.cat([live[torch.randperm(live.numel(), generator=g)[:n]], torch.tensor([-1, (1 << 32) | 2])])
    masks = [p.hit_touch(vals) for p in policies]
    for h in masks[1:]:
        assert torch.equal(h, masks[0])
    assert masks[0].tolist() == [True] * (vals.numel() - 2) + [False, False]
    return masks[0]


def on_both_paths(monkeypatch, make, triton_mod, ref_mod):
    """The same policy built twice: on the Triton kernels (interpreted) and on the reference;
    asserts which kernel module (``_k``) each got."""
    pols = []
    for force in ("1", "0"):
        monkeypatch.setenv("ULACACHE_FORCE_TRITON", force)
        pols.append(make())
    assert pols[0]._k is triton_mod and pols[1]._k is ref_mod
    return pols
