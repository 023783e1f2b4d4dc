"""Process bodies of the two-rank gloo tests (tests/test_tp_shard.py): each rank builds a
sharded `UlaWorkerStore` with a real `TPExchange` and runs the same steps."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

HEAD = 8
BS = 16


def row(addrs: torch.Tensor, layer: int) -> torch.Tensor:
    return (addrs.float() * 10 + layer).unsqueeze(1).expand(-1, HEAD).contiguous()


def make_store(rank: int, world: int, group, device_slots: int, host_slots: int,
               remote_slots: int, layers=("l.0", "l.1", "l.2"), leaders=("l.0", "l.2"),
               lockstep=True):
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.sizing import UlaLayout
    from ulacache_vllm.engine.tp_shard import TokenShard, TPExchange
    from ulacache_vllm.engine.worker_store import UlaWorkerStore

    n_logical = (device_slots + host_slots) * world
    layout = UlaLayout(block_size=BS, device_slots=device_slots, host_slots=host_slots,
                       num_logical=n_logical, num_blocks=n_logical // BS + 1,
                       mla_layers=list(layers), leaders=list(leaders),
                       mla_row_bytes={n: HEAD * 4 for n in layers}, mla_head_size=HEAD,
                       mla_dtype="float32", indexer_bytes_per_token=0, tp_mode="shard",
                       tp_world=world, remote_slots=remote_slots)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    ex = TPExchange(TokenShard(rank, world), group, lockstep_check=lockstep)
    store = UlaWorkerStore(layout, UlaSettings(), mods, torch.device("cpu"), None, ex)
    return store, mods


def write_step(store, mods, addrs, freed=()):
    store.begin_step(list(freed), {n: addrs for n in mods})
    for li, (name, mod) in enumerate(mods.items()):
        slots = mod.impl.translator.write_slots(name, addrs)
        mod.kv_cache.view(-1, HEAD).index_copy_(0, slots, row(addrs, li))


def read(mods, logical):
    """What attention reads in each layer (device rows, then staged sources)."""
    out = {}
    for name, mod in mods.items():
        t = mod.impl.translator
        dev, staged = t.resolve(name, logical, None)
        got = torch.full((*logical.shape, HEAD), -1.0)
        on_dev = dev >= 0
        got[on_dev] = mod.kv_cache.view(-1, HEAD).index_select(0, dev[on_dev])
        for ids, rows in zip(staged, t.staged_rows(name)):
            there = ids >= 0
            assert not bool((on_dev & there).any()), "a row read from two places"
            got[there] = rows.view(-1, HEAD).index_select(0, ids[there])
        out[name] = got
    return out


def _init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    return dist.group.WORLD


def skewed_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank 0 owns most of the live tokens (even addresses) and overflows its device pool
    when a step reads them; rank 1 does not. Every read must be exact on both ranks, the
    exchanges stay in lockstep (checked), and freeing everything empties every pool."""
    group = _init(rank, world, init_file)
    store, mods = make_store(rank, world, group, device_slots=48, host_slots=512,
                             remote_slots=64)
    live = []
    for s in range(8):
        base = 32 + s * 64
        a = torch.cat([torch.arange(base, base + 64, 2), torch.arange(base + 1, base + 9, 2)])
        write_step(store, mods, a)
        live.append(a)
    live = torch.cat(live)
    g = torch.Generator().manual_seed(1)
    errors, steps = 0, 6
    for s in range(steps):
        store.begin_step([], {})
        # Mostly even (rank 0's) entries: 3 tokens x 40 picks > rank 0's 48 device slots.
        picks = torch.stack([live[torch.randperm(live.numel(), generator=g)[:40]]
                             for _ in range(3)])
        if s % 2:
            picks[2, 30:] = -1
        got = read(mods, picks)
        valid = picks >= 0
        for li, name in enumerate(mods):
            errors += int((got[name][valid] != row(picks[valid], li)).any())
    store.begin_step([], {})
    c = store.totals()
    usage_mid = store.usage()
    blocks = sorted(set((live // BS).tolist()))
    store.begin_step(blocks, {})
    usage_end = store.usage()
    json.dump({"errors": errors, "totals": c, "mid": usage_mid, "end": usage_end,
               "identity": store.identity},
              open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.destroy_process_group()


def diverging_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank 1 issues a different exchange than rank 0: the lockstep check raises on both."""
    from ulacache_vllm.engine.tp_shard import LockstepError, TokenShard, TPExchange

    group = _init(rank, world, init_file)
    ex = TPExchange(TokenShard(rank, world), group, lockstep_check=True)
    ex.step = 3
    msg = ""
    try:
        if rank == 0:
            ex.request(torch.tensor([1, 3]), layer=0)
        else:
            ex.all_gather(torch.zeros(4), "candidates", layer=5)
    except LockstepError as e:
        msg = str(e)
    json.dump({"error": msg}, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.destroy_process_group()
