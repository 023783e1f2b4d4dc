"""UlaWorkerStore without an engine: the worker contract clause by clause. Row contents encode
their logical address and layer, so any misplaced read or write is caught.

- outside the forward (`begin_step`): frees, settle (last step's selections made resident:
  hits touched, host rows promoted), round, this step's write slots;
- inside the forward: resolve + stage only (no move, no table change), padding to a trash row;
- identity fast path, adoption on overflow, a selection larger than the device pool."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ulacache_vllm.engine.config import UlaSettings
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


def step(store, mods, addrs, freed=()):
    """One engine step's pre-forward half and its KV writes: every layer writes rows whose
    value is (address, layer) through its translator, as the sparse-MLA impl does."""
    store.begin_step(list(freed), {name: addrs for name in mods})
    for li, (name, mod) in enumerate(mods.items()):
        slots = mod.impl.translator.write_slots(name, addrs)
        mod.kv_cache.view(-1, HEAD).index_copy_(0, slots, _row(addrs, li))


def _row(addrs, li):
    return (addrs.float() * 10 + li).unsqueeze(1).expand(-1, HEAD).contiguous()


def read_all(mods, logical, req_of_token):
    """What attention reads for ``logical`` in each layer: device rows, host rows staged."""
    out = {}
    for name, mod in mods.items():
        t = mod.impl.translator
        dev, staged = t.resolve(name, logical, req_of_token)
        got = torch.full((*logical.shape, HEAD), -1.0)
        on_dev = dev >= 0
        got[on_dev] = mod.kv_cache.view(-1, HEAD).index_select(0, dev[on_dev])
        for ids, rows in zip(staged, t.staged_rows(name)):
            there = ids >= 0
            assert not bool((on_dev & there).any()), "a row in two places"
            got[there] = rows.view(-1, HEAD).index_select(0, ids[there])
        out[name] = got
    return out


def _tables(store):
    return [(g.mapping.loc.clone(), g.mapping.device_used, g.mapping.host_used)
            for g in store.groups]


def test_every_layer_gets_its_translator_explicitly():
    store, mods = make_store(layers=("l.0", "l.1", "l.2"), leaders=("l.0", "l.2"))
    t = [mods[n].impl.translator for n in mods]
    assert t[0] is t[1] and t[2] is not t[0]  # one translator per layer group
    assert [mods[n].impl.layer_name for n in mods] == list(mods)


def test_identity_fast_path_then_adopt_on_overflow():
    store, mods = make_store()
    a = torch.arange(16, 48)  # below the device pool size: identity placement
    step(store, mods, a)
    assert store.identity
    assert torch.equal(mods["l.0"].impl.translator.write_slots("l.0", a), a)
    b = torch.arange(200, 240)  # beyond the device range: mapped placement, before the forward
    step(store, mods, b)
    assert not store.identity
    assert store.counters.fast_path_exits == 1
    u = store.usage()
    assert u["device_used"] + u["host_used"] == 2 * (a.numel() + b.numel())
    sel = torch.cat([a[:16], b[:24]]).unsqueeze(0)  # adopted entries kept their data in place
    got = read_all(mods, sel, torch.zeros(1, dtype=torch.int64))
    for li, name in enumerate(mods):
        assert torch.equal(got[name][0], _row(sel[0], li))


def test_padding_writes_go_to_the_trash_row_not_a_live_slot():
    store, mods = make_store()
    step(store, mods, torch.arange(0, 16))
    before = mods["l.0"].kv_cache.view(-1, HEAD)[:64].clone()
    t = mods["l.0"].impl.translator
    padded = torch.tensor([16, -1, 17])
    store.begin_step([], {n: padded for n in mods})
    slots = t.write_slots("l.0", padded)
    assert slots[1].item() == t.trash_slot == 64 and slots[0].item() >= 0
    mods["l.0"].kv_cache.view(-1, HEAD).index_copy_(0, slots, torch.full((3, HEAD), 7.0))
    after = mods["l.0"].kv_cache.view(-1, HEAD)
    assert torch.equal(after[:16], before[:16])  # nothing live was overwritten


@pytest.mark.parametrize("lru", LRU_CHOICES)
def test_forward_only_resolves_and_stages_and_the_next_step_settles(lru):
    store, mods = make_store(device_slots=64, host_slots=512, lru=lru)
    live = []
    for s in range(10):  # 10 steps x 40 new tokens = 400 entries >> 64 device slots
        a = torch.arange(16 + s * 40, 16 + (s + 1) * 40)
        step(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    u = store.usage()
    assert u["host_used"] > 0 and u["device_used"] <= 2 * 64
    assert u["device_used"] + u["host_used"] == 2 * live.numel()
    store.begin_step([], {})
    # 4 tokens select 8 old entries each (32 < 64 device slots), padding included.
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:8]] for _ in range(4)])
    picks[3, 6:] = -1
    before, counters = _tables(store), dict(vars(store.counters))
    got = read_all(mods, picks, torch.arange(4))
    valid = picks >= 0
    for li, name in enumerate(mods):  # exact rows, host ones staged
        assert torch.equal(got[name][valid], _row(picks[valid], li))
        assert bool((got[name][~valid] == -1).all())
    # Inside the forward nothing moved and no table changed.
    for (loc0, d0, h0), (loc1, d1, h1) in zip(before, _tables(store)):
        assert torch.equal(loc0, loc1) and (d0, h0) == (d1, h1)
    assert vars(store.counters) == counters
    on_host = [sum((x >= 0).sum().item() for x in t.resolve(n, picks, None)[1])
               for n, t in ((n, mods[n].impl.translator) for n in mods)]
    assert sum(on_host) > 0, "the test must read some host rows"
    # The next step's pre-forward half settles the read: the picks are device-resident now.
    store.begin_step([], {})
    assert store.counters.promotions > 0 and store.counters.lookups > store.counters.hits > 0
    for name, mod in mods.items():
        dev, staged = mod.impl.translator.resolve(name, picks, None)
        assert bool((dev[valid] >= 0).all()) and all(bool((x < 0).all()) for x in staged)
    assert {getattr(g.mapping.policy, "inner", g.mapping.policy).name for g in store.groups} == {lru}
    # Freeing every block returns both pools to empty and re-enables identity placement.
    store.begin_step(sorted(set((live // BS).tolist())), {})
    assert store.usage()["device_used"] == 0 and store.usage()["host_used"] == 0
    assert store.identity


def test_a_selection_larger_than_the_device_pool_is_read_exactly_and_settled_in_part():
    store, mods = make_store(device_slots=64, host_slots=512)
    live = []
    for s in range(10):
        a = torch.arange(16 + s * 40, 16 + (s + 1) * 40)
        step(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    store.begin_step([], {})
    g = torch.Generator().manual_seed(1)
    picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:24]] for _ in range(8)])
    got = read_all(mods, picks, torch.arange(8))  # 192 distinct-ish rows > 64 device slots
    for li, name in enumerate(mods):
        assert torch.equal(got[name].reshape(-1, HEAD), _row(picks.reshape(-1), li))
    store.begin_step([], {})
    assert store.counters.fallback_chunks > 0  # only part of the working set was promoted
    assert store.counters.promotions > 0
    got = read_all(mods, picks, torch.arange(8))  # still exact after the partial settle
    for li, name in enumerate(mods):
        assert torch.equal(got[name].reshape(-1, HEAD), _row(picks.reshape(-1), li))


def test_impl_without_a_translator_raises():
    from ulacache_vllm.engine.cpu_sparse_mla import CpuSparseMLAImpl

    impl = SimpleNamespace(translator=None, layer_name="model.layers.3.self_attn.attn")
    with pytest.raises(RuntimeError, match="layers.3.*no KV translator"):
        CpuSparseMLAImpl._translator(impl)
