"""The arena worker's step executor (`ArenaWorker.apply`: one gather + one scatter per copy
step, one fill for new pages, on 8-byte words) against the per-page reference (slice copies and
slice zeroing in a Python loop, `CopyPlan.apply`), side by side on the same plans: page moves
of a compaction plus zeroing of as many new pages, and zeroing alone (a step that only
allocates). Prints a table; writes `results/arena_apply.{json,png}`.

    python benchmarks/arena_apply.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ulacache_vllm.arena import CopyPlan
from ulacache_vllm.engine.arena.worker import ArenaWorker

RESULTS = Path(__file__).parent / "results"


def _plan(page: int, n: int, alignment: int, copies: bool, rng):
    slots = rng.permutation(4 * n)
    src, dst, new = (slots[i * n:(i + 1) * n] * page for i in range(3))
    step = np.stack([src, dst, np.full(n, page)], 1).astype(np.int64)
    zero = np.stack([new, np.full(n, page)], 1).astype(np.int64)
    placed = np.concatenate([dst, new]) if copies else new
    return SimpleNamespace(copies=[step] if copies else [], vids=np.arange(1, len(placed) + 1),
                           granules=placed // alignment, sizes=np.full(len(placed), page),
                           new=zero, stats={})


def _reference(buf: torch.Tensor, plan) -> None:
    CopyPlan(plan.copies).apply(buf)
    for off, n in plan.new.tolist():
        buf[off:off + n].zero_()


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    shapes = [(64 << 10, 1), (64 << 10, 8), (64 << 10, 64), (8 << 10, 1024)]
    if not args.quick:
        shapes += [(64 << 10, 256), (2 << 10, 8), (512 << 10, 16)]
    reps = 10 if args.quick else 40
    rows = []
    print(f"{'plan':<34}{'reference ms':>14}{'apply ms':>10}{'speedup':>9}")
    for page, n in shapes:
        a = min(page, 4096)
        for copies in (True, False):
            plan = _plan(page, n, a, copies, rng)
            buf = torch.randint(-128, 127, (4 * n * page,), dtype=torch.int8)
            check = buf.clone()
            w = ArenaWorker(SimpleNamespace(buffer_bytes=buf.numel(), alignment=a,
                                             zero_new_pages=True), {"l": buf})
            w.apply(plan)
            _reference(check, plan)
            assert torch.equal(buf, check), "the executors disagree"
            ref = _time(lambda: _reference(check, plan), reps)
            new = _time(lambda: w.apply(plan), reps)
            w.close()
            what = f"{n} x {page >> 10} KiB " + ("moved + zeroed" if copies else "zeroed")
            rows.append({"page_bytes": page, "pages": n, "copies": copies,
                         "reference_s": ref, "apply_s": new})
            print(f"{what:<34}{ref * 1e3:>14.3f}{new * 1e3:>10.3f}{ref / new:>8.2f}x")
    name = "arena_apply_quick" if args.quick else "arena_apply"
    RESULTS.mkdir(exist_ok=True)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _host, beside this script
    from _host import cpu_host

    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"host": cpu_host(), "threads": 1, "reps": reps, "rows": rows}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['pages']}x{r['page_bytes'] >> 10}K{'+mv' if r['copies'] else ''}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["reference_s"] * 1e3 for r in rows], 0.4, label="per-page reference")
    ax.bar(x + 0.2, [r["apply_s"] * 1e3 for r in rows], 0.4, label="ArenaWorker.apply")
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote results/{name}.json, .png")


if __name__ == "__main__":
    main()
