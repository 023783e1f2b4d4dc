"""UlaWorkerStore without an engine: identity fast path, adoption on overflow, exclusive
tiers, and the chunked attention fallback when one step's selections exceed the device pool.
Row contents encode their logical address, so any misplaced read is caught."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulacache_vllm.engine.config import UlaSettings
from ulacache_vllm.engine.kv_translation import get_translator
from ulacache_vllm.engine.sizing import UlaLayout
from ulacache_vllm.engine.wiring import LRU_CHOICES
from ulacache_vllm.engine.worker_store import UlaWorkerStore

HEAD = 8
BS = 16


def make_store(device_slots=64, host_slots=512, layers=("l.0", "l.1"), leaders=("l.0", "l.1"),
               lru="pblru"):
    layout = UlaLayout(block_size=BS, device_slots=device_slots, host_slots=host_slots,
                       num_logical=device_slots + host_slots,
                       num_blocks=(device_slots + host_slots) // BS + 1,
                       mla_layers=list(layers), leaders=list(leaders),
                       mla_row_bytes={n: HEAD * 4 for n in layers}, mla_head_size=HEAD,
                       mla_dtype="float32", indexer_bytes_per_token=0)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    return UlaWorkerStore(layout, UlaSettings(lru=lru), mods, torch.device("cpu")), mods


def write(store, mods, addrs):
    """One step's KV write: every layer writes rows whose value is (address, layer)."""
    for li, (name, mod) in enumerate(mods.items()):
        slots = get_translator(name).write_slots(name, addrs)
        rows = mod.kv_cache.view(-1, HEAD)
        rows.index_copy_(0, slots, _row(addrs, li))


def _row(addrs, li):
    return (addrs.float() * 10 + li).unsqueeze(1).expand(-1, HEAD).contiguous()


def read_all(store, mods, logical, req_of_token):
    """Reads every layer's selected rows through the translator, chunk by chunk."""
    out = {}
    for li, (name, mod) in enumerate(mods.items()):
        got = torch.full((*logical.shape, HEAD), -1.0)
        for s, e, slots in get_translator(name).read_chunks(name, logical, req_of_token):
            rows = mod.kv_cache.view(-1, HEAD)
            valid = slots >= 0
            got[s:e][valid] = rows.index_select(0, slots[valid])
        out[name] = got
    return out



def test_identity_fast_path_then_adopt_on_overflow():
    store, mods = make_store()
    store.begin_step([])
    a = torch.arange(16, 48)  # below the device pool size: identity placement
    write(store, mods, a)
    assert store.identity
    assert torch.equal(get_translator("l.0").write_slots("l.0", a), a)
    store.begin_step([])
    b = torch.arange(200, 240)  # beyond the device range: switch to mapped placement
    write(store, mods, b)
    assert not store.identity
    assert store.counters.fast_path_exits == 1
    u = store.usage()
    assert u["device_used"] + u["host_used"] == 2 * (a.numel() + b.numel())
    # Adopted entries kept their data in place.
    sel = torch.cat([a[:16], b[:24]]).unsqueeze(0)  # one token selects 40 of 64 slots
    got = read_all(store, mods, sel, torch.zeros(1, dtype=torch.int64))
    for li, name in enumerate(mods):
        assert torch.equal(got[name][0], _row(sel[0], li))


@pytest.mark.parametrize("lru", LRU_CHOICES)
def test_spills_and_chunked_fallback_keep_data_exact(lru):
    store, mods = make_store(device_slots=64, host_slots=512, lru=lru)
    live = []
    for step in range(10):  # 10 steps x 40 new tokens = 400 entries >> 64 device slots
        store.begin_step([])
        a = torch.arange(16 + step * 40, 16 + (step + 1) * 40)
        write(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    u = store.usage()
    assert u["host_used"] > 0 and u["device_used"] <= 2 * 64
    assert u["device_used"] + u["host_used"] == 2 * live.numel()
    # One step whose 8 tokens select 24 distinct old entries each: 192 > 64 device slots.
    store.begin_step([])
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:24]] for _ in range(8)])
    picks[3, 20:] = -1  # padding stays padding
    req_of_token = torch.arange(8)
    got = read_all(store, mods, picks, req_of_token)
    for li, name in enumerate(mods):
        valid = picks >= 0
        assert torch.equal(got[name][valid], _row(picks[valid], li))
        assert bool((got[name][~valid] == -1).all())
    assert store.counters.fallback_chunks > 0
    assert store.counters.promotions > 0 and store.counters.demotions > 0
    assert {getattr(g.mapping.policy, "inner", g.mapping.policy).name for g in store.groups} == {lru}
    # Freeing every block returns both pools to empty and re-enables identity placement.
    store.begin_step(sorted(set((live // BS).tolist())))
    assert store.usage()["device_used"] == 0 and store.usage()["host_used"] == 0
    assert store.identity
