"""Shared test helper: where a mapping's entries are, read the way the product reads them
(`TieredMapping.locate`, the committed table)."""

import torch

from ulacache_vllm.core import DEVICE, HOST


def tier_and_slot(m, addrs):
    """``(tier, slot)`` of each address, shaped like ``addrs``: ``DEVICE`` or ``HOST`` and the
    slot there; ``(-1, -1)`` for unmapped entries and -1 padding. Asserts that ``locate``
    never reports an entry on both tiers."""
    a = torch.as_tensor(addrs, dtype=torch.int64, device=m.device)
    dev, host = m.locate(a)
    assert dev.shape == a.shape and host.shape == a.shape
    on_dev, on_host = dev >= 0, host >= 0
    assert not bool((on_dev & on_host).any()), "an entry located on both tiers"
    tier = torch.where(on_dev, DEVICE, torch.where(on_host, HOST, -1))
    return tier, torch.where(on_dev, dev, host)


def located(m, addrs) -> torch.Tensor:
    """``locate``'s two answers stacked (``[2, *addrs.shape]``): to compare snapshots."""
    return torch.stack(m.locate(torch.as_tensor(addrs, dtype=torch.int64, device=m.device)))
