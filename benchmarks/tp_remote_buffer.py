"""TP mode: rows fetched from other ranks per step, with and without the remote-row buffer.

With MLA KV sharded by token (entry ``t`` on rank ``t % P``) each rank reads the selected rows
the other ranks own. Without a buffer every such row is fetched each step it is selected;
with ``RemoteRowBuffer`` only rows not fetched recently are. Replays a DSA-like trace (or a
recorded one, ``--trace``) on every rank of P = 2, 4, 8 with buffers of several sizes
(multiples of the most remote rows one rank reads in one round), and
prints the fetched rows per step and their ratio to no buffer, plus the buffer's hit rate and
bytes per step for a DeepSeek-V3.2 row (656 B per token per layer, 61 layers). Writes
``benchmarks/results/tp_remote_buffer.{json,png}``.

    python benchmarks/tp_remote_buffer.py --quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from ulacache_vllm.core import RemoteRowBuffer, TokenShard

import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parent))  # _host, beside this script
from _host import cpu_host  # noqa: E402
from lab.trace import generate_dsa_trace, load_trace  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW_BYTES = 656 * 61  # DeepSeek-V3.2: fp8 latent + rope + scales per token per layer, 61 layers


def remote_demand(trace, P: int) -> int:
    """The most remote rows one rank reads in one round of one layer group."""
    per = {}
    for st in trace.steps:
        if st.select_addr.numel():
            key = (st.step, st.group)
            per[key] = torch.cat([per[key], st.select_addr]) if key in per else st.select_addr
    best = 0
    for sel in per.values():
        u = sel.unique()
        u = u[u >= 0]
        # rank r reads all but its own share: the most for the rank owning the fewest
        best = max(best, u.numel() - min(int(TokenShard(r, P).owned(u).sum()) for r in range(P)))
    return best


def replay(trace, P: int, slots: int) -> dict:
    """Every rank replays the trace (one buffer per rank and layer group); returns mean rows
    fetched per step per rank with the buffer and without, and the buffer hit rate."""
    groups = sorted({st.group for st in trace.steps})
    shards = [TokenShard(r, P) for r in range(P)]
    bufs = {(g, r): RemoteRowBuffer(trace.num_logical, slots, rank=r, world_size=P)
            for g in groups for r in range(P)}
    fetched = unbuffered = 0
    steps, last = set(), None
    for st in trace.steps:
        if last is not None and st.step != last:
            for b in bufs.values():
                b.advance_round()
        last = st.step
        steps.add(st.step)
        if st.free_addr.numel():
            for r in range(P):
                bufs[st.group, r].invalidate(st.free_addr)
        sel = st.select_addr
        if not sel.numel():
            continue
        u = sel.unique()
        u = u[u >= 0]
        for r in range(P):
            b = bufs[st.group, r]
            own = int(shards[r].owned(u).sum())
            unbuffered += u.numel() - own
            # A step's misses are fetched (a buffer that cannot keep them all fetches again).
            fetched += int((b.slots_of(u) < 0).sum()) - own
            b.settle(sel)
    n = max(1, len(steps)) * P
    hits = sum(b.stats.hits for b in bufs.values())
    looks = sum(b.stats.lookups for b in bufs.values())
    return dict(fetched=fetched / n, unbuffered=unbuffered / n, hit_rate=hits / max(1, looks))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trace", help="replay a recorded trace (.npz / .jsonl) instead of a synthetic one")
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--sizes", type=float, nargs="*", default=[1.0, 2.0, 4.0],
                    help="buffer slots as multiples of the most remote rows a rank reads in a round")
    ap.add_argument("--overlap", type=float, nargs=2, default=[0.6, 0.95], metavar=("LO", "HI"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.trace:
        tr = load_trace(a.trace)
    else:
        steps, topk = (40, 256) if a.quick else (80, 2048)
        prompt = (2048, 6144) if a.quick else (8192, 24576)
        tr = generate_dsa_trace(num_steps=steps, batch=8 if a.quick else 32, topk=topk,
                                prompt_len=prompt, decode_len=(steps, 2 * steps),
                                prefill_chunk=topk, overlap=tuple(a.overlap), seed=7)
    rows, t0 = [], time.time()
    print(f"{'P':>3} {'size':>5} {'slots':>8} | {'no buffer':>10} {'buffered':>10} {'ratio':>6} "
          f"{'hit %':>6} | {'MB/step no buf':>14} {'MB/step buf':>11}")
    for P in a.ranks:
        if P < 2:
            raise SystemExit("--ranks: TP needs at least 2 ranks")
        demand = remote_demand(tr, P)
        for f in a.sizes:
            slots = max(1, int(f * demand))
            r = dict(P=P, size=f, slots=slots, **replay(tr, P, slots))
            r["ratio"] = r["fetched"] / r["unbuffered"] if r["unbuffered"] else 0.0
            rows.append(r)
            print(f"{P:>3} {f:>5.1f} {slots:>8} | {r['unbuffered']:>10.1f} {r['fetched']:>10.1f} "
                  f"{r['ratio']:>6.3f} {100 * r['hit_rate']:>6.1f} | "
                  f"{r['unbuffered'] * ROW_BYTES / 1e6:>14.2f} {r['fetched'] * ROW_BYTES / 1e6:>11.2f}",
                  flush=True)
    print(f"(rows per step per rank; ratio = buffered / no buffer; {time.time() - t0:.1f}s)")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "tp_remote_buffer_quick" if a.quick else "tp_remote_buffer"
    cfg = dict(quick=a.quick, trace=a.trace, overlap=a.overlap, peak_demand=tr.peak_demand)
    (out / f"{name}.json").write_text(json.dumps(dict(config=cfg, host=cpu_host(), rows=rows), indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for f in a.sizes:
            rs = [r for r in rows if r["size"] == f]
            ax.plot([str(r["P"]) for r in rs], [r["ratio"] for r in rs], marker="o",
                    label=f"buffer {f:g}x round demand")
        ax.set(xlabel="TP ranks", ylabel="remote rows fetched, buffered / unbuffered", ylim=(0, 1))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {out / (name + '.json')}")


if __name__ == "__main__":
    main()
