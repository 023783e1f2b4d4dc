"""Micro-benchmark of ulacache's DSA per-step work without an engine (issue 30 item 3).

Drives `UlaWorkerStore` exactly as the sparse-MLA backend does in one decode step: the
pre-forward ``begin_step`` (frees, settle, round, writes), then per layer ``write_slots`` + the
KV write, ``resolve``, ``staged_rows`` and `sparse_mla_attention` over ``[device | staged]``
rows; sizes are the ``dsa-pressure`` quick mode's (tiny DeepSeek-V3.2: 2 sparse-MLA layers of
one group each, 576 float32 per row, top-k 16, 12 requests of 512 tokens, device pool 2176
rows, host pool 4384) or the fast path's (everything in the device pool).

The selection is drawn per token from its request's positions: ``--reuse`` of the previous
step's picks kept (the indexer's selections move slowly), the rest uniform.

``--compare REV`` unpacks that git revision's ``ulacache_vllm`` + ``kernels`` as a package
``ulacache_before`` and runs both trees in one process, alternating step by step (A B, B A,
...) on the same inputs (same seeds, so the same selections), and checks that both read the
same rows (identical attention outputs). Phases are timed in thread CPU time
(``time.thread_time``), not wall time, to keep other processes' load out; a loaded host still
moves both sides alike (caches and memory bandwidth are shared), hence the alternation.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# CPU time of this thread (torch runs one thread here): other processes' load on the shared
# host stretches wall time but not this (caches and memory bandwidth are still shared).
CLOCK = time.thread_time
REPO = HERE.parents[0]


def before_tree(rev: str, dest: str) -> str:
    """``rev``'s ``ulacache_vllm`` and ``kernels`` as one importable package ``ulacache_before``
    under ``dest`` (module names rewritten), so one process runs both trees side by side."""
    root = Path(dest)
    pkg = root / "ulacache_before"
    if not pkg.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / "_src"
        tmp.mkdir(exist_ok=True)
        arc = subprocess.run(["git", "-C", str(REPO), "archive", rev, "ulacache_vllm", "kernels"],
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=arc, check=True)
        (tmp / "ulacache_vllm").rename(pkg)
        (tmp / "kernels").rename(pkg / "kernels")
        for f in pkg.rglob("*.py"):
            f.write_text(f.read_text().replace("ulacache_vllm", "ulacache_before"))
    return str(root)


class Sim:
    """One store (from package ``pkg``) driven through the decode steps of the batch."""

    def __init__(self, pkg: str, args):
        import importlib
        from types import SimpleNamespace

        import torch

        mod = lambda name: importlib.import_module(f"{pkg}.{name}")  # noqa: E731
        UlaSettings = mod("engine.config").UlaSettings
        UlaLayout = mod("engine.dsa.sizing").UlaLayout
        self.slots_to_rows = mod("engine.dsa.kv_translation").slots_to_rows
        self.attn = mod("engine.dsa.sparse_math").sparse_mla_attention
        N, L, M, K = args.requests, args.prompt, args.steps, args.topk
        self.bs, self.head, self.H = bs, head, H = 16, 576, 4
        per_req = -(-(L + M + 1) // bs) * bs
        total = N * per_req
        if args.mode == "fast":
            dev_slots, host_slots = -(-total // bs) * bs + bs * 4, 0
        else:
            dev_slots = args.device_slots
            host_slots = total - dev_slots + bs * 8
        self.layers = layers = ["model.layers.0.attn", "model.layers.1.attn"]
        layout = UlaLayout(block_size=bs, device_slots=dev_slots, host_slots=host_slots,
                           num_logical=dev_slots + host_slots,
                           num_blocks=(dev_slots + host_slots) // bs + 1,
                           mla_layers=layers, leaders=list(layers),
                           mla_row_bytes={n: head * 4 for n in layers}, mla_head_size=head,
                           mla_dtype="float32", indexer_bytes_per_token=0)
        self.mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
        self.st = mod("engine.dsa.store").UlaWorkerStore(layout, UlaSettings(), self.mods,
                                                          torch.device("cpu"))
        self.args, self.L, self.N, self.K = args, L, N, K
        self.g = torch.Generator().manual_seed(args.seed)
        base = torch.arange(N) * per_req + bs  # block 0 is vLLM's null block
        self.base = base[torch.randperm(N, generator=self.g)]  # requests not in address order
        self.q = torch.randn(N, H, head, generator=self.g)
        self.req = torch.arange(N)
        self.times = {k: [] for k in PHASES}
        self.outs = []
        # begin_step split (exclusive, thread CPU): settle lookups, writes' assign, the two as
        # one plan (`Residency.settle_and_write`), the moves (`TierMoves.apply`: copies +
        # commit), the rest (frees, rounds, bookkeeping). The store's parts call each other
        # through these attributes, so wrapping them on the part times every call.
        self.split = {k: 0.0 for k in SPLIT}
        self._stack: list = []
        # (A tree from before the store was parts: its own private methods.)
        parts = hasattr(self.st, "residency")
        for part, attr, old, key in (("residency", "settle", "_settle", "settle"),
                                     ("residency", "prepare_writes", "_prepare_writes", "writes"),
                                     ("residency", "settle_and_write", "_settle_and_write",
                                      "settle_writes"),
                                     ("moves", "apply", "_apply", "copies")):
            obj = getattr(self.st, part) if parts else self.st
            name = attr if parts else old
            if hasattr(obj, name):  # (a tree from before the merged plan has no such step)
                setattr(obj, name, self._timed(getattr(obj, name), key))

    def _timed(self, fn, key):
        def wrapper(*a, **k):
            self._stack.append([CLOCK(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                t0, child = self._stack.pop()
                dt = CLOCK() - t0
                self.split[key] += dt - child
                if self._stack:
                    self._stack[-1][1] += dt
        return wrapper

    def write(self, addrs):
        for name in self.layers:
            t = self.mods[name].impl.translator
            slots = t.write_slots(name, addrs)
            rows = self.mods[name].kv_cache.view(-1, self.head)
            rows[slots] = addrs.float().unsqueeze(1).expand(-1, self.head)

    def prefill(self):
        """Whole prompts, 2048 tokens a step, each prompt token selecting top-k."""
        import torch

        L, K, g = self.L, self.K, self.g
        per_step = max(1, max(2048, L) // L)
        for i in range(0, self.N, per_step):
            take = range(i, min(self.N, i + per_step))
            addrs = torch.cat([self.base[r] + torch.arange(L) for r in take])
            self.st.begin_step([], {n: addrs for n in self.layers})
            self.write(addrs)
            pos = torch.cat([torch.randint(0, L, (L, K), generator=g) for _ in take])
            logical = torch.cat([self.base[r].expand(L, K) for r in take]) + pos
            for name in self.layers:
                self.mods[name].impl.translator.resolve(name, logical, None)
        self.prev = torch.randint(0, L, (self.N, K), generator=g)

    def decode_step(self, s: int) -> None:
        import torch

        g, N, K = self.g, self.N, self.K
        n_ctx = self.L + s
        new = self.base + n_ctx
        fresh = torch.randint(0, n_ctx + 1, (N, K), generator=g)
        keep = torch.rand(N, K, generator=g) < self.args.reuse
        self.prev = torch.where(keep & (self.prev <= n_ctx), self.prev, fresh)
        logical = self.base.unsqueeze(1) + self.prev
        st, mods = self.st, self.mods
        split0 = dict(self.split)
        t0 = CLOCK()
        st.begin_step([], {n: new for n in self.layers})
        t1 = CLOCK()
        inner = 0.0
        for k in SPLIT:
            d = self.split[k] - split0[k]
            self.times[k].append(d * 1e3)
            inner += d
        self.times["begin_rest"].append((t1 - t0 - inner) * 1e3)
        self.write(new)
        t2 = CLOCK()
        tr = ts = ta = tp = 0.0
        outs = []
        for name in self.layers:
            t = mods[name].impl.translator
            a = CLOCK()
            dev, staged = t.resolve(name, logical, self.req)
            b = CLOCK()
            rows = self.slots_to_rows(dev, self.bs, self.bs)
            srcs = t.staged_rows(name)
            c = CLOCK()
            kv_rows = mods[name].kv_cache.view(-1, self.head)
            out, _ = self.attn(self.q, kv_rows, rows, 0.1, 512, staged=list(zip(staged, srcs)))
            d = CLOCK()
            # The same attention without staged sources (stock's call, all rows on the
            # device): attend - attend_plain is the staged gather's own cost.
            self.attn(self.q, kv_rows, rows, 0.1, 512, staged=[])
            tp += CLOCK() - d
            outs.append(out)
            tr += b - a
            ts += c - b
            ta += d - c
        for k, v in (("begin", t1 - t0), ("kv_write", t2 - t1), ("resolve", tr), ("stage", ts),
                     ("attend", ta), ("attend_plain", tp), ("step", (t1 - t0) + (t2 - t1) + tr
                                                            + ts + ta)):
            self.times[k].append(v * 1e3)
        self.outs.append(torch.stack(outs))

    def summary(self) -> dict:
        w = self.args.warm
        out = {k: statistics.median(v[w:]) for k, v in self.times.items()}
        out["first_steps"] = [round(x, 3) for x in self.times["step"][:5]]
        out["promotions"] = sum(gr.mapping.stats.promotions for gr in self.st.groups)
        out["demotions"] = sum(gr.mapping.stats.demotions for gr in self.st.groups)
        out["identity"] = self.st.identity
        return out


SPLIT = ("settle", "writes", "settle_writes", "copies")
PHASES = ("begin", "settle", "writes", "settle_writes", "copies", "begin_rest", "kv_write",
          "resolve", "stage", "attend", "attend_plain", "step")


def run_worker(args) -> dict:
    """Both trees in this process, step by step in alternation (A B A B ...), same inputs."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO))
    sims = {}
    if args.compare:
        sys.path.insert(0, before_tree(args.compare, args.before_dir))
        sims["before"] = Sim("ulacache_before", args)
    sims["after"] = Sim("ulacache_vllm", args)
    for sim in sims.values():
        sim.prefill()
    prof = None
    if getattr(args, "cprofile", 0):
        import cProfile

        prof = cProfile.Profile(CLOCK)
    for s in range(args.steps):
        if prof is not None and s == args.warm:
            prof.enable()
        order = list(sims.values()) if s % 2 == 0 else list(sims.values())[::-1]
        for sim in order:
            sim.decode_step(s)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats(args.sort).print_stats(args.cprofile)
    res = {k: sim.summary() for k, sim in sims.items()}
    if "before" in sims:  # the same rows read: the attention outputs are identical
        res["outputs_identical"] = all(
            torch.equal(a, b) for a, b in zip(sims["before"].outs, sims["after"].outs))
        w = args.warm
        res["paired_ratio_step"] = statistics.median(
            a / b for a, b in zip(sims["after"].times["step"][w:],
                                  sims["before"].times["step"][w:]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("pressure", "fast"), default="pressure")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--device-slots", type=int, default=2176)
    ap.add_argument("--reuse", type=float, default=0.5)
    ap.add_argument("--warm", type=int, default=4, help="decode steps left out of the medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile the timed decode steps, print the top N functions")
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--compare", default=None, metavar="REV",
                    help="a git revision: run its tree beside this one, step by step")
    ap.add_argument("--before-dir", default="/tmp/ula_before_pkg",
                    help="where the revision's tree is unpacked (reused if present)")
    ap.add_argument("--pairs", type=int, default=3, help="runs (seeds)")
    ap.add_argument("--cpu", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    doc = {"args": vars(args), "loadavg": os.getloadavg()}
    runs = []
    for seed in range(args.seed, args.seed + args.pairs):
        args.seed = seed
        runs.append(run_worker(args))
    args.seed -= args.pairs - 1
    doc["runs"] = runs
    sides = [k for k in ("before", "after") if k in runs[0]]
    print(f"mode {args.mode}, {args.pairs} seeds x {args.steps} steps, sides alternating step "
          f"by step in one process; load {os.getloadavg()[0]:.1f}")
    print(f"{'phase':8s} " + " ".join(f"{k:>8s}" for k in sides) + "   (thread CPU ms/step, "
          "median over seeds of the per-run medians)")
    summary = {}
    for k in PHASES:
        vals = {sd: statistics.median(r[sd][k] for r in runs) for sd in sides}
        summary[k] = {sd: round(v, 4) for sd, v in vals.items()}
        print(f"{k:8s} " + " ".join(f"{vals[sd]:8.3f}" for sd in sides))
    if "before" in runs[0]:
        pr = [r["paired_ratio_step"] for r in runs]
        print(f"paired step ratio after/before: median {statistics.median(pr):.3f} "
              f"[{min(pr):.3f}, {max(pr):.3f}]; outputs identical: "
              f"{all(r['outputs_identical'] for r in runs)}")
        summary["paired_ratio_step"] = pr
    for sd in sides:
        print(sd, "first steps", runs[0][sd]["first_steps"], "promotions/demotions",
              runs[0][sd]["promotions"], runs[0][sd]["demotions"])
    doc["summary"] = summary
    doc["loadavg_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
