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


def row(addrs: torch.Tensor, layer: int, version: int = 0) -> torch.Tensor:
    return (addrs.float() * 10 + layer + 1e5 * version).unsqueeze(1).expand(-1, HEAD).contiguous()


def make_store(rank: int, world: int, group, device_slots: int, host_slots: int,
               remote_slots: int, layers=("l.0", "l.1", "l.2"), leaders=("l.0", "l.2"),
               lockstep=True, settings=None):
    from ulacache_vllm.engine.config import UlaSettings
    from ulacache_vllm.engine.dsa.sizing import UlaLayout
    from ulacache_vllm.engine.dsa.tp_shard import TokenShard, TPExchange
    from ulacache_vllm.engine.dsa.store import UlaWorkerStore

    n_logical = (device_slots + host_slots) * world
    layout = UlaLayout(block_size=BS, device_slots=device_slots, host_slots=host_slots,
                       num_logical=n_logical, num_blocks=n_logical // BS + 1,
                       mla_layers=list(layers), leaders=list(leaders),
                       mla_row_bytes={n: HEAD * 4 for n in layers}, mla_head_size=HEAD,
                       mla_dtype="float32", indexer_bytes_per_token=0, tp_mode="shard",
                       tp_world=world, remote_slots=remote_slots)
    mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
    ex = TPExchange(TokenShard(rank, world), group, lockstep_check=lockstep)
    store = UlaWorkerStore(layout, settings or UlaSettings(), mods, torch.device("cpu"), None,
                           ex)
    return store, mods


def write_step(store, mods, addrs, freed=(), version=0):
    store.begin_step(list(freed), {n: addrs for n in mods})
    for li, (name, mod) in enumerate(mods.items()):
        slots = mod.impl.translator.write_slots(name, addrs)
        mod.kv_cache.view(-1, HEAD).index_copy_(0, slots, row(addrs, li, version))


def read(mods, logical):
    """What attention reads in each layer (device rows, then staged sources)."""
    from test_worker_store import read_all

    return read_all(mods, logical, None)


def run_in_turn(rank: int, world: int, out_dir: str, workers) -> None:
    """Runs each of ``workers`` (the bodies below) in turn in this rank's process, each with a
    process group of its own (a fresh init file) and its results under ``out_dir/<name>``."""
    for fn in workers:
        d = os.path.join(out_dir, fn.__name__)
        os.makedirs(d, exist_ok=True)
        fn(rank, world, os.path.join(d, "init"), d)


def _init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    return dist.group.WORLD


def skewed_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank 0 owns most of the live tokens (even addresses) and overflows its device pool
    when a step reads them; rank 1 does not. Every read must be exact on both ranks, the
    exchanges stay in lockstep (checked), and freeing everything empties every pool."""
    from ulacache_vllm.engine.config import UlaSettings

    group = _init(rank, world, init_file)
    # Every host row read is promoted (promote_after 1), so a step's read overflows rank 0's
    # pool in its settle (chunked), which this test is about.
    store, mods = make_store(rank, world, group, device_slots=48, host_slots=512,
                             remote_slots=64, settings=UlaSettings(promote_after=1))
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
    dist.barrier()
    dist.destroy_process_group()


def diverging_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank 1 issues a different exchange than rank 0: the lockstep check raises on both."""
    from ulacache_vllm.engine.dsa.tp_shard import LockstepError, TokenShard, TPExchange

    group = _init(rank, world, init_file)
    ex = TPExchange(TokenShard(rank, world), group, lockstep_check=True)
    ex.step = 3
    msg = ""
    try:
        if rank == 0:
            ex.all_gather(torch.zeros(4, dtype=torch.uint8), "rows", layer=0)
        else:
            ex.all_gather(torch.zeros(4), "candidates", layer=5)
    except LockstepError as e:
        msg = str(e)
    json.dump({"error": msg}, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def replica_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Replicated while everything fits one rank's device pool (reads are local, no
    exchange), then shards from the step that writes past it (every rank at once), back to
    replicas once everything is freed; reads exact throughout."""
    group = _init(rank, world, init_file)
    # 72 device rows per rank: the replica limit is whole blocks (64), not 72.
    store, mods = make_store(rank, world, group, device_slots=72, host_slots=256,
                             remote_slots=32)
    log = {"limit": store.replica_limit}
    a = torch.arange(16, 56)  # below the replica limit
    write_step(store, mods, a)
    store.begin_step([], {})
    g = torch.Generator().manual_seed(rank + 7)  # each rank's own picks: no exchange needed
    picks = a[torch.randperm(a.numel(), generator=g)[:12]].view(3, 4)
    before = store.exchange.gathers
    got = read(mods, picks)
    log["replica_exact"] = all(torch.equal(got[n], row(picks.reshape(-1), i).view(3, 4, HEAD))
                               for i, n in enumerate(mods))
    log["replica_gathers"] = store.exchange.gathers - before
    log["replica_usage"] = store.usage()["device_used"]
    b = torch.arange(56, 160)  # past it: shards from this step on
    write_step(store, mods, b)
    log["replicas_after"] = store.replicas
    live = torch.cat([a, b])
    errors = 0
    for s in range(4):
        store.begin_step([], {})
        picks = live[torch.randperm(live.numel(), generator=torch.Generator().manual_seed(s))[:30]]
        picks = picks.view(3, 10)
        got = read(mods, picks)
        for i, n in enumerate(mods):
            errors += int(not torch.equal(got[n], row(picks.reshape(-1), i).view(3, 10, HEAD)))
    log["shard_errors"] = errors
    log["shard_usage"] = store.usage()["device_used"] + store.usage()["host_used"]
    store.begin_step(sorted(set((live // BS).tolist())), {})
    log["replicas_again"] = store.replicas
    log["end_usage"] = store.usage()
    c = write_step(store, mods, torch.arange(16, 32)) or torch.arange(16, 32)
    store.begin_step([], {})
    got = read(mods, c.view(2, 8))
    log["again_exact"] = all(torch.equal(got[n], row(c, i).view(2, 8, HEAD))
                             for i, n in enumerate(mods))
    log["totals"] = store.totals()
    json.dump(log, open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def rewrite_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Speculative decoding rewrites rejected drafts' rows in place (the same addresses, no
    free in between). Rows another rank fetched and buffered must never be served stale
    after their owner rewrote them: every read after a rewrite sees the new bytes."""
    group = _init(rank, world, init_file)
    store, mods = make_store(rank, world, group, device_slots=48, host_slots=512,
                             remote_slots=64)
    live = torch.arange(16, 16 + 8 * 64)
    for s in range(8):  # past one rank's device pool: sharded
        write_step(store, mods, live[s * 64:(s + 1) * 64])
    tail = live[-24:]  # "draft" rows: read (fetched, then buffered), then rewritten
    picks = tail.unsqueeze(0)
    errors, stale_before = 0, 0
    for _ in range(2):
        store.begin_step([], {})
        got = read(mods, picks)
        errors += sum(int((got[n][0] != row(tail, li)).any()) for li, n in enumerate(mods))
    buffered = int((store.groups[0].remote.slots_of(tail[~store.shard.owned(tail)]) >= 0).sum())
    for version in (1, 2):  # rewritten twice, read in the rewriting step and the next one
        write_step(store, mods, tail, version=version)
        got = read(mods, picks)
        errors += sum(int((got[n][0] != row(tail, li, version)).any())
                      for li, n in enumerate(mods))
        store.begin_step([], {})
        got = read(mods, picks)
        errors += sum(int((got[n][0] != row(tail, li, version)).any())
                      for li, n in enumerate(mods))
    json.dump({"errors": errors, "buffered": buffered, "replicas": store.replicas,
               "totals": store.totals()},
              open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def fill_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The remote-row buffer's fill control on two ranks: reads that seldom hit the buffer
    (random picks over many rows) stop its settles, except a probe every 16 steps; reads
    that repeat (the same picks every step) bring the fills back after a probe. Every read
    is exact throughout, and both ranks' directories stay identical."""
    from ulacache_vllm.engine.config import UlaSettings

    group = _init(rank, world, init_file)
    store, mods = make_store(rank, world, group, device_slots=600, host_slots=64,
                             remote_slots=64, settings=UlaSettings())
    live = torch.arange(16, 16 + 1024)
    for s in range(16):  # more than one rank's pool: sharded
        write_step(store, mods, live[s * 64:(s + 1) * 64])
    g = torch.Generator().manual_seed(3)
    errors = 0

    def step(picks):
        nonlocal errors
        store.begin_step([], {})
        got = read(mods, picks)
        for li, name in enumerate(mods):
            errors += int((got[name].view(-1, HEAD) != row(picks.reshape(-1), li)).any())

    for _ in range(24):  # random picks: ~6 % of them can hit 64 buffered rows of 1024
        step(live[torch.randperm(live.numel(), generator=g)[:32]].view(2, 16))
    low = dict(store.totals())
    fixed = live[torch.randperm(live.numel(), generator=g)[:32]].view(2, 16)
    for _ in range(32):  # the same picks every step
        step(fixed)
    store.begin_step([], {})
    t = store.totals()
    tables = [grp.remote.table.tolist() for grp in store.groups]
    json.dump({"errors": errors, "low": low, "totals": t, "replicas": store.replicas,
               "tables": tables, "rates": [grp.remote.hit_rate for grp in store.groups]},
              open(os.path.join(out_dir, f"rank{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()
