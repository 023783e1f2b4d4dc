"""The CPU indexer's per-request work, before and after shape-independent scores, side by side.

Times what `cpu_indexer.indexer_forward_cpu` does for one request: read its keys from a paged
fp8 indexer cache and select the top-k. After: `read_fp8_keys` + `select_topk` (the whole
indexer's selection: `indexer_scores.certified_logits`, float32 products in tiles with the keys
near the k-th score rescored exactly, the exact top-k). Before: the `.float()` read and the
float32 BLAS product they replaced (`lab/indexer_fp32_blas.py`), whose selection can depend on
the keys scored beside. Same inputs, interleaved repeat by repeat, in one process.
Shapes: decode (a few queries over long histories) and prefill chunks, at DeepSeek-V3.2's
indexer (64 heads of 128) and the tiny test models' (8 heads). Prints median ms and the
ratio per shape (median over repeats of after/before); writes JSON and Markdown to
``benchmarks/results/indexer_scores.{json,md}``.

    python benchmarks/indexer_scores.py [--repeats 7] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _host import cpu_host  # noqa: E402
from lab.indexer_fp32_blas import read_keys_float, select_topk_fp32_blas  # noqa: E402

from ulacache_vllm.engine.dsa.cpu_indexer import (  # noqa: E402
    read_fp8_keys,
    select_topk,
    write_keys,
)

BLOCK = 64

SHAPES = [  # (label, queries, heads, keys, topk)
    ("decode b1 L2k H64", 1, 64, 2048, 2048),
    ("decode b1 L16k H64", 1, 64, 16384, 2048),
    ("decode b4 L8k H64", 4, 64, 8192, 2048),
    ("decode b4 L4k H8", 4, 8, 4096, 16),
    ("prefill 256 L2k H64", 256, 64, 2048, 2048),
    ("prefill 2k from 0 H64", 2048, 64, 2048, 2048),
    ("prefill 512 L4k H8", 512, 8, 4096, 16),
    # Every query past the top-k (scored in full, no query's prefix selected whole):
    ("decode b1 L2k H64 k512", 1, 64, 2048, 512),
    ("prefill 256 L4k H64 k512", 256, 64, 4096, 512),
    ("prefill 2k from 0 H64 k512", 2048, 64, 2048, 512),
]


def inputs(n, H, L, seed=0):
    """Queries (fp8 values, as the indexer's q_quant), weights, a paged fp8 key cache holding
    L keys in shuffled blocks, its block-table row, query positions."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, H, 128, generator=g) * 8).to(torch.float8_e4m3fn).float()
    nb = (L + BLOCK - 1) // BLOCK
    cache = torch.zeros(nb + 3, BLOCK, 132, dtype=torch.uint8)
    row = torch.randperm(nb + 3, generator=g)[:nb].to(torch.int32)
    slots = (row.long().repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(nb))[:L]
    write_keys(cache, torch.randn(L, 128, generator=g), slots)
    return q, torch.randn(n, H, generator=g), cache, row, torch.arange(L - n, L)


def before(q, w, cache, row, pos, k):
    return select_topk_fp32_blas(q, w, read_keys_float(cache, row, int(pos[-1]) + 1), pos, k)


def after(q, w, cache, row, pos, k):
    # The engine hands the indexer's q_quant over as fp8 (before: decoded to float32 first,
    # outside the timed call; here its decode is inside).
    q8 = q.to(torch.float8_e4m3fn)
    return select_topk(q8, w, read_fp8_keys(cache, row, int(pos[-1]) + 1), pos, k)


def _time(fn, *args):
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="first four shapes, 3 repeats")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "indexer_scores"))
    a = ap.parse_args(argv)
    shapes = SHAPES[:4] if a.quick else SHAPES
    repeats = 3 if a.quick else a.repeats
    rows = []
    for label, n, H, L, k in shapes:
        args = (*inputs(n, H, L), k)
        before(*args), after(*args)  # warm-up
        t_before, t_after = [], []
        for r in range(repeats):
            pair = [(t_before, before), (t_after, after)]
            for out, fn in (pair if r % 2 == 0 else pair[::-1]):
                out.append(_time(fn, *args))
        before_ms, after_ms = t_before, t_after
        ratio = statistics.median(x / y for x, y in zip(after_ms, before_ms))
        rows.append({"shape": label, "queries": n, "heads": H, "keys": L, "topk": k,
                     "before_ms": before_ms, "after_ms": after_ms, "ratio_median": ratio,
                     "ratio_min": min(x / y for x, y in zip(after_ms, before_ms)),
                     "ratio_max": max(x / y for x, y in zip(after_ms, before_ms))})
        print(f"{label:24s} before {statistics.median(before_ms):8.2f} ms  after "
              f"{statistics.median(after_ms):8.2f} ms  after/before {ratio:.3f} "
              f"[{rows[-1]['ratio_min']:.3f}, {rows[-1]['ratio_max']:.3f}]", flush=True)
    res = {"host": cpu_host(), "threads": torch.get_num_threads(), "repeats": repeats,
           "rows": rows}
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(f"# Indexer top-k: certified float32 (exact selection) vs the float32 BLAS product\n\n"
                f"`benchmarks/indexer_scores.py`, one process, {repeats} interleaved repeats, "
                f"{torch.get_num_threads()} threads; host: {res['host']['cpu']} "
                f"(amx_tile={res['host']['amx_tile']}).\n\n"
                "| shape | before ms (median) | after ms (median) | after/before median [min, max] |\n"
                "|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['shape']} | {statistics.median(r['before_ms']):.2f} | "
                    f"{statistics.median(r['after_ms']):.2f} | {r['ratio_median']:.3f} "
                    f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] |\n")
    return res


if __name__ == "__main__":
    main()
