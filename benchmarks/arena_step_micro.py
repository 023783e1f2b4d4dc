"""The arena's per-step Python outside the forward, in-process and without an engine, against
stock vLLM's KV cache manager on the same groups: ``allocate_slots`` for every request of a
step, the scheduler's ``take_step`` (the step plan and its stats), the worker's ``apply``,
``translate`` (two block tables) and ``stats``. The shape is ``equal_batch.py --quick``'s
short arena batch on GPT-OSS-like groups (12 requests, 96 prompt tokens, 24 decode steps;
sliding window 128 and full attention, 32-token pages). Timed: the decode steps that allocate
no page (the common step), median us per step; and the page events, median us per round: the
first decode step (every request crosses into a new page of each group: allocation, the plan,
its apply, with the new pages zeroed where vLLM would zero them) and the end (every request freed).

Hot loops: every figure is far below what the same code costs inside an engine step, where
the forward has evicted it from the caches (equal_batch.py --profile measures that); use this
to compare code versions (run it with ``PYTHONPATH`` on another checkout), not as a step cost.

    python benchmarks/arena_step_micro.py [--rounds N] [--prof]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from types import SimpleNamespace

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request, RequestStatus

from ulacache_vllm.engine.arena.manager import ArenaKVCacheManager
from ulacache_vllm.engine.arena.sizing import ArenaGroup, ArenaLayout, needs_zeroing
from ulacache_vllm.engine.arena.worker import ArenaWorker
from ulacache_vllm.engine.line import UlaKVCacheConfig

BS, MAX_LEN, N, L, M = 32, 512, 12, 96, 24
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
SWA = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32,
                        sliding_window=128)
PAGE = FULL.page_size_bytes * 2  # two layers per group
PAGES = 600


def _groups():
    return [KVCacheGroupSpec(["l0", "l2"], SWA), KVCacheGroupSpec(["l1", "l3"], FULL)]


def arena_manager() -> ArenaKVCacheManager:
    groups = [ArenaGroup("sliding", "low", ("l0", "l2"), PAGE, BS, 5),
              ArenaGroup("full", "high", ("l1", "l3"), PAGE, BS, MAX_LEN // BS)]
    total = PAGES * PAGE
    # New pages zeroed where the engine zeroes them (``plan_arena``: vLLM's rule; not here).
    zero = needs_zeroing([(g.layer_names, g.kv_cache_spec) for g in _groups()])
    layout = ArenaLayout(groups, PAGE, total, total + PAGE, total + PAGE, MAX_LEN,
                         zero_new_pages=zero)
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=_groups())
    return ArenaKVCacheManager(UlaKVCacheConfig.of(cfg, layout), max_model_len=MAX_LEN,
                               scheduler_block_size=BS, hash_block_size=BS,
                               enable_caching=False, max_in_flight_tokens=BS)


def stock_manager() -> KVCacheManager:
    cfg = KVCacheConfig(num_blocks=PAGES, kv_cache_tensors=[], kv_cache_groups=_groups())
    return KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=BS,
                          hash_block_size=BS, enable_caching=False, max_in_flight_tokens=BS)


def _block_table():
    """What ``ArenaWorker.translate`` reads of vLLM's ``BlockTable``."""
    cpu = torch.zeros(N, MAX_LEN // BS, dtype=torch.int32)
    return SimpleNamespace(block_table=SimpleNamespace(cpu=cpu, gpu=torch.zeros_like(cpu)))


def run(mgr, worker, rounds: int, timers: dict, events: dict | None = None) -> None:
    events = {} if events is None else events
    tables = [_block_table(), _block_table()]
    for r in range(rounds):
        reqs = [Request(f"r{r}-{i}", list(range(1, L + 1)), SamplingParams(max_tokens=1000),
                        None) for i in range(N)]
        for step in range(M + 1):
            if worker is not None:
                mgr.new_step_starts()
            t = [time.perf_counter()]
            for q in reqs:
                assert mgr.allocate_slots(q, 1 if step else L) is not None
                q.status = RequestStatus.RUNNING
            t.append(time.perf_counter())
            if worker is not None:
                plan = mgr.take_step()
                t.append(time.perf_counter())
                worker.apply(plan)
                t.append(time.perf_counter())
                for bt in tables:
                    worker.translate(bt, N)
                t.append(time.perf_counter())
                worker.stats(0)
                t.append(time.perf_counter())
                mgr.step_processed(plan)
            if step > 1:  # decode steps that allocate nothing
                for k, a, b in zip(timers, t, t[1:]):
                    timers[k].append(b - a)
            elif step == 1:  # token L + 1: a new page of each group for every request
                events.setdefault("first_decode_step", []).append(t[-1] - t[0])
            for q in reqs:
                q.num_computed_tokens += 1 if step else L
                q.append_output_token_ids(7)
        t0 = time.perf_counter()
        for q in reqs:
            mgr.free(q)
        events.setdefault("free_all", []).append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prof", action="store_true", help="cProfile the arena's timed rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name in ("stock", "arena"):
        timers = {k: [] for k in ("allocate_slots", "take_step", "apply", "translate",
                                  "worker_stats")}
        if name == "stock":
            mgr, worker = stock_manager(), None
        else:
            mgr = arena_manager()
            buf = torch.zeros(mgr.layout.buffer_bytes, dtype=torch.int8)
            worker = ArenaWorker(mgr.layout, {n: buf for g in mgr.layout.groups
                                              for n in g.layer_names})
        run(mgr, worker, 3, {k: [] for k in timers})  # warm-up
        prof = cProfile.Profile() if args.prof and worker is not None else None
        if prof:
            prof.enable()
        events: dict = {}
        run(mgr, worker, args.rounds, timers, events)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        out[name] = {k: 1e6 * float(np.median(v)) for k, v in timers.items() if v}
        out[name + " events"] = {k: 1e6 * float(np.median(v)) for k, v in events.items()}
    print(f"us per step, median over {args.rounds * (M - 1)} decode steps that allocate no page "
          f"({N} requests):")
    for name, d in out.items():
        if not name.endswith("events"):
            print(f"  {name:6s}", "  ".join(f"{k} {v:6.1f}" for k, v in d.items()))
    print(f"page events, us per round, median over {args.rounds} rounds (stock: allocation "
          f"alone; the arena: allocation, take_step, apply (zeroing only where vLLM zeroes), "
          f"translate, stats):")
    for name in ("stock", "arena"):
        d = out[name + " events"]
        print(f"  {name:6s}", "  ".join(f"{k} {v:7.1f}" for k, v in d.items()))
    print(f"  allocate_slots, arena - stock: "
          f"{out['arena']['allocate_slots'] - out['stock']['allocate_slots']:+.1f} us per step")


if __name__ == "__main__":
    main()
