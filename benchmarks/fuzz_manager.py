"""Long fuzz run of the scheduler-facing manager + worker store (see lab/manager_fuzz.py):
random admit / append / finish / preempt / abort / deferred-free operations checked against a
reference model after each one. ``--arena``: the hybrid arena's manager and worker instead
(lab/arena_fuzz.py: admit, chunked prefill, decode, finish, preempt, abort, forced and needed
moves, failing copies), checked after every engine step. ``--v4``: the DeepSeek-V4 line's
manager (the arena and the CSA rows' logical block pool) with the arena's worker and the CSA
rows' store (lab/v4_fuzz.py), on drawn layer schedules, budgets and step sizes, failing
copies (arena pages and CSA rows) in a third of the runs. Prints
operations per second and the counts; exits non-zero on the first violated invariant.

    python benchmarks/fuzz_manager.py --ops 100000 --seeds 3
    python benchmarks/fuzz_manager.py --arena --ops 100000 --seeds 3
    python benchmarks/fuzz_manager.py --arena --caching --ops 100000 --seeds 3
    python benchmarks/fuzz_manager.py --v4 [--caching] --ops 20000 --seeds 3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lab, beside this script
from lab.manager_fuzz import run  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=100_000, help="operations per seed")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--no-worker", action="store_true", help="the manager alone (faster)")
    ap.add_argument("--arena", action="store_true", help="the hybrid arena's manager + worker")
    ap.add_argument("--v4", action="store_true",
                    help="the DeepSeek-V4 line's manager, arena worker and CSA rows")
    ap.add_argument("--caching", action="store_true",
                    help="--arena / --v4 with vLLM's prefix caching on (hits, evictions, resets)")
    args = ap.parse_args(argv)
    if args.arena:
        return _arena(args)
    if args.v4:
        return _v4(args)
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        st = run(seed, args.ops, worker=not args.no_worker)
        dt = time.perf_counter() - t0
        print(f"seed {seed}: {args.ops} ops in {dt:.1f} s ({args.ops / dt:.0f}/s), ops {st.ops}, "
              f"refused {st.refused}, reported dead {st.reported_dead}, worker promotions "
              f"{st.worker_promotions}, demotions {st.worker_demotions}: all invariants held")
    return 0


def _arena(args) -> int:
    import logging

    from lab.arena_fuzz import run as run_arena

    logging.getLogger("vllm.ulacache").setLevel(logging.CRITICAL)  # the injected faults' lines
    # Per seed: three arenas (ample with forced moves, tight with forced moves, tight with
    # moves only when needed) and the tight one with failing copies; ~10 operations a step.
    configs = [(96, 3, 0), (48, 3, 0), (48, 0, 0), (48, 3, 8)]
    for seed in range(args.seeds):
        for pages, force, faults in configs:
            t0, steps, ops = time.perf_counter(), 0, 0
            st = None
            while ops < args.ops // len(configs):
                st = run_arena(seed * 1000 + steps, 2000, total_pages=pages,
                               force_moves=force, fault_every=faults,
                               caching=args.caching)
                steps += st.steps
                ops += sum(st.ops.values())
            dt = time.perf_counter() - t0
            print(f"seed {seed} arena of {pages} pages, forced moves every {force or '-'}, "
                  f"faults 1/{faults or '-'}: {ops} ops over {steps} steps in {dt:.1f} s "
                  f"({ops / dt:.0f}/s); last run: ops {st.ops}, refused {st.refused}, "
                  f"compactions {st.compactions}, relayouts {st.relayouts}, lost pages "
                  f"{st.lost_pages}, hit tokens {st.hit_tokens}, cache evictions "
                  f"{st.cache_evictions}, cached pages moved {st.cached_pages_moved}, resets "
                  f"{st.resets}: all invariants held")
    return 0


def _v4(args) -> int:
    import logging
    import random

    from lab.v4_fuzz import SCHEDULES
    from lab.v4_fuzz import run as run_v4

    logging.getLogger("vllm.ulacache").setLevel(logging.CRITICAL)  # the injected faults' lines
    for seed in range(args.seeds):
        t0, steps, ops, part = time.perf_counter(), 0, 0, 0
        while ops < args.ops:
            rng = random.Random(seed * 1000 + part)
            kw = dict(ratios=rng.choice(SCHEDULES), arena_requests=rng.choice((1.5, 2.5, 4)),
                      host_requests=rng.choice((1.2, 2.5, 4)), force_moves=rng.choice((0, 0, 3)),
                      max_model_len=rng.choice((1024, 2048)), batch=rng.choice((256, 512, 1024)),
                      fault_every=rng.choice((0, 0, 8)))
            st = run_v4(seed * 1000 + part, 300, caching=args.caching,
                        csa_faults=bool(kw["fault_every"]), **kw)
            steps, ops, part = steps + st.steps, ops + sum(st.ops.values()), part + 1
            print(f"  {kw}: ops {st.ops}, refused {st.refused}, preempted {st.preempted}, "
                  f"hit tokens {st.hit_tokens}, CSA demotions {st.csa['demotions']} promotions "
                  f"{st.csa['promotions']}, compactions {st.arena['arena_compactions']}, "
                  f"relayouts {st.arena['arena_relayouts']}, transient state pages "
                  f"{st.arena['transient_state_pages']}, lost pages {st.lost_pages}, lost CSA "
                  f"blocks {st.lost_csa_blocks} (failed row copies {st.csa['failed_copies']})",
                  flush=True)
        dt = time.perf_counter() - t0
        print(f"seed {seed} v4{' with prefix caching' if args.caching else ''}: {ops} ops over "
              f"{steps} steps in {dt:.1f} s ({ops / dt:.0f}/s): all invariants held", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
