"""Long fuzz run of the scheduler-facing manager + worker store (see lab/manager_fuzz.py):
random admit / append / finish / preempt / abort / deferred-free operations checked against a
reference model after each one. Prints operations per second and the counts; exits non-zero
on the first violated invariant.

    python benchmarks/fuzz_manager.py --ops 100000 --seeds 3
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
    args = ap.parse_args(argv)
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        st = run(seed, args.ops, worker=not args.no_worker)
        dt = time.perf_counter() - t0
        print(f"seed {seed}: {args.ops} ops in {dt:.1f} s ({args.ops / dt:.0f}/s), ops {st.ops}, "
              f"refused {st.refused}, reported dead {st.reported_dead}, worker promotions "
              f"{st.worker_promotions}, demotions {st.worker_demotions}: all invariants held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
