"""Long seeded random walks over the arena that must reach every ladder step, with every copy
plan applied to a real byte tensor and all invariants checked after each operation."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from ulacache_vllm.arena import COMPACT, RELAYOUT, REUSE, SHORTFALL, Arena

from ._model import Shadow, demand_fits_reference
from .test_arena_fuzz import ALIGN, make_kinds


def walk(seed: int, ops: int = 300):
    rng = np.random.default_rng(seed)
    kinds = make_kinds(int(rng.integers(1, 12)), int(rng.integers(2, 16)), int(rng.integers(1, 150)))
    arena = Arena(int(rng.integers(10, 30)) * max(k.page_bytes(ALIGN) for k in kinds), kinds,
                  alignment=ALIGN)
    sh = Shadow(arena, seed)
    steps: dict[str, int] = {}
    fences = []
    for _ in range(ops):
        op = rng.choice(["admit", "admit", "grow", "shrink", "shrink", "free", "fence", "pass"])
        reqs = arena.requests()
        if op in ("admit", "grow"):
            if op == "admit" or not reqs:
                dem = {0: int(rng.integers(0, 5)), 1: int(rng.integers(0, 4)), 2: int(rng.integers(0, 2))}
                res = arena.admit(object(), dem)
            else:
                k = int(rng.integers(0, 3))
                dem = {k: int(rng.integers(1, 4))}
                res = arena.grow(reqs[rng.integers(len(reqs))], k, dem[k])
            sh.apply(res.copy_plan)
            steps[res.step] = steps.get(res.step, 0) + 1
            need = sum(n * arena.page_bytes[k] for k, n in dem.items())
            if res.ok:
                sh.write_new(res.vids)
            elif need <= arena.free_bytes:
                assert arena.ledger.open_fences(), "shortfall with room and no fences"
                assert not demand_fits_reference(arena, dem)
                twin = copy.deepcopy(arena)
                for f in twin.ledger.open_fences():
                    f.complete()
                assert twin.admit("twin", dem).ok
        elif op == "shrink" and reqs:
            rid = reqs[rng.integers(len(reqs))]
            k = int(rng.integers(0, 3))
            held = arena.pages(rid, k)
            if len(held):
                drop = rng.choice(held, size=int(rng.integers(1, len(held) + 1)), replace=False)
                arena.shrink(rid, k, drop)
                sh.forget(drop)
        elif op == "free" and reqs:
            rid = reqs[rng.integers(len(reqs))]
            sh.forget([v for k in range(3) for v in arena.pages(rid, k).tolist()])
            arena.free(rid)
        elif op == "fence" and reqs and rng.random() < 0.5:
            rid = reqs[rng.integers(len(reqs))]
            vids = np.concatenate([arena.pages(rid, k) for k in range(3)])
            if len(vids):
                f = arena.fence("fwd")
                sh.register(rng.choice(vids, size=min(2, len(vids)), replace=False), f)
                fences.append(f)
        elif op == "pass" and fences:
            fences.pop(int(rng.integers(len(fences)))).complete()
        sh.check()
    for rid in arena.requests():
        arena.free(rid)
    for f in fences:
        f.complete()
    assert arena.free_extents() == [(0, arena.total_bytes)] and arena.band_bounds == (0, arena.total_bytes)
    return steps, arena.stats


def test_walks_reach_every_ladder_step():
    total: dict[str, int] = {}
    for seed in range(12):
        steps, _ = walk(seed)
        for k, v in steps.items():
            total[k] = total.get(k, 0) + v
    for step in (REUSE, COMPACT, RELAYOUT, SHORTFALL):
        assert total.get(step, 0) > 0, f"ladder step {step} never exercised: {total}"


@pytest.mark.parametrize("seed", [100, 101, 102])
def test_walk_seeds(seed):
    walk(seed, ops=400)
