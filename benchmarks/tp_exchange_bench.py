"""Micro-benchmark of DSA TP shard mode's per-step worker work at P = 2 (issue 30, TP=2).

Two gloo ranks (two processes, one invocation, as `tests/_tp_workers.py`) each drive a sharded
`UlaWorkerStore` through the decode steps of the ``dsa-tp2`` quick shape of
`benchmarks/equal_batch.py` (tiny DeepSeek-V3.2: 2 sparse-MLA layers of one group each, 576
float32 per row, top-k 16, 6 requests of 192 tokens + 24 out, each rank's device pool 0.75 of
the batch's tokens, a remote-row buffer of requests x top-k rows) exactly as the engine does
per step: ``begin_step`` (frees, settle of local and remote rows, writes), the KV write, then
per layer the indexer's candidate exchange as `cpu_indexer._sharded_forward` runs it (pack a
[T, 2K] float32 payload, all-gather, unpack, merge the global top-k; the candidates are random,
from their own seed), ``resolve`` (buffer lookups, the step's miss plan) and
``staged_rows`` (the row all-gather). Attention is left out (the same on both sides); every
read row is checked against the bytes written for its address.

The selection: per token, ``--reuse`` of the previous step's picks kept, the rest uniform over
its request's positions; the newest token always picked (causal DSA keeps it). Identical on
both ranks (same seed), as the real indexer's merged top-k is.

``--compare REV`` unpacks that revision's ``ulacache_vllm`` as ``ulacache_before`` (see
`equal_batch_store.before_tree`) and each rank runs both trees over its own pair of exchanges
on the same gloo group, alternating step by step (A B, B A, ...). Phases are thread CPU time
(``time.thread_time``: a rank's own work, not the wait for the other rank nor other
processes' load); the step's wall time is reported beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[0]
CLOCK = time.thread_time

# Phases (ms per decode step, exclusive, thread CPU): begin_step split by the store methods it
# calls, the KV write, per layer the candidate gather, resolve (lookups + plan) and the row
# gather (`staged_rows`), and the step total (CPU and wall).
SPLIT = ("settle_remote", "settle", "writes", "copies")
PHASES = ("begin", *SPLIT, "begin_rest", "kv_write", "candidates", "resolve", "rows",
          "step", "step_wall")


class Sim:
    def __init__(self, pkg: str, args, rank: int, group):
        import importlib
        from types import SimpleNamespace

        import torch

        mod = lambda name: importlib.import_module(f"{pkg}.{name}")  # noqa: E731
        UlaSettings = mod("engine.config").UlaSettings
        UlaLayout = mod("engine.dsa.sizing").UlaLayout
        tp = mod("engine.dsa.tp_shard")
        P = 2
        N, L, M, K = args.requests, args.prompt, args.steps, args.topk
        self.bs, self.head = bs, head = 16, 576
        per_req = -(-(L + M + 1) // bs) * bs
        total = N * per_req
        lbs = bs // P
        dev = -(-int(args.device_frac * N * (L + M)) // lbs) * lbs
        host = -(-(total // P) // lbs) * lbs + bs * 4
        remote = -(-(N * K) // lbs) * lbs
        n_logical = (dev + host) * P
        self.layers = layers = ["model.layers.0.attn", "model.layers.1.attn"]
        layout = UlaLayout(block_size=bs, device_slots=dev, host_slots=host,
                           num_logical=n_logical, num_blocks=n_logical // bs + 1,
                           mla_layers=layers, leaders=list(layers),
                           mla_row_bytes={n: head * 4 for n in layers}, mla_head_size=head,
                           mla_dtype="float32", indexer_bytes_per_token=0, tp_mode="shard",
                           tp_world=P, remote_slots=remote)
        self.mods = {n: SimpleNamespace(kv_cache=None, impl=SimpleNamespace()) for n in layers}
        self.ex = tp.TPExchange(tp.TokenShard(rank, P), group, lockstep_check=False)
        self.topk = mod("engine.dsa.topk")
        self.st = mod("engine.dsa.store").UlaWorkerStore(layout, UlaSettings(), self.mods,
                                                          torch.device("cpu"), None, self.ex)
        self.args, self.L, self.N, self.K = args, L, N, K
        self.g = torch.Generator().manual_seed(args.seed)
        self.gc = torch.Generator().manual_seed(args.seed + 1)  # candidates (own stream)
        base = torch.arange(N) * per_req + bs  # block 0 is vLLM's null block
        self.base = base[torch.randperm(N, generator=self.g)]
        self.times = {k: [] for k in PHASES}
        self.split = {k: 0.0 for k in SPLIT}
        self.errors = 0
        self._stack: list = []
        # The store's parts call each other through these attributes (a tree from before the
        # store was parts: its own private methods).
        parts = hasattr(self.st, "residency")
        for part, attr, old, key in (("sharded", "settle", "_settle_remote", "settle_remote"),
                                     ("residency", "settle", "_settle", "settle"),
                                     ("residency", "prepare_writes", "_prepare_writes", "writes"),
                                     ("moves", "apply", "_apply", "copies")):
            obj = getattr(self.st, part) if parts else self.st
            name = attr if parts else old
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
        for li, name in enumerate(self.layers):
            slots = self.mods[name].impl.translator.write_slots(name, addrs)
            rows = self.mods[name].kv_cache.view(-1, self.head)
            rows[slots] = (addrs.float() * 10 + li).unsqueeze(1).expand(-1, self.head)

    def _candidates(self, T: int, li: int):
        """The indexer's exchange as `cpu_indexer._sharded_forward` runs it: pack this rank's
        candidates, all-gather, unpack, merge into the global top-k."""
        import torch

        tk = self.topk
        r = self.ex.shard.rank
        vals = torch.randn(T, self.K, generator=self.gc)
        pos = (torch.randperm(4 * self.K * T, generator=self.gc)[: T * self.K]
               .view(T, self.K) * 2 + r).int().sort(dim=-1).values  # this rank's
        everyone = self.ex.all_gather(tk.pack_candidates(vals, pos), "candidates", li)
        sc, pc = tk.unpack_candidates(everyone)
        tk.merge_candidates(sc, pc, self.K)

    def _read(self, logical, check: bool):
        """Per layer: candidates, resolve, staged rows; returns the phase times."""
        import torch

        tc = tr = tf = 0.0
        for li, name in enumerate(self.layers):
            t = self.mods[name].impl.translator
            a = CLOCK()
            self._candidates(logical.shape[0], li)
            b = CLOCK()
            dev, staged = t.resolve(name, logical, None)
            c = CLOCK()
            srcs = t.staged_rows(name)
            d = CLOCK()
            tc, tr, tf = tc + b - a, tr + c - b, tf + d - c
            if check:  # column 0 of every read row == the bytes written for its address
                got = torch.full(logical.shape, -1.0)
                on = dev >= 0
                got[on] = self.mods[name].kv_cache.view(-1, self.head)[:, 0][dev[on]]
                for ids, rows in zip(staged, srcs):
                    there = ids >= 0
                    got[there] = rows.view(-1, self.head)[:, 0][ids[there]]
                v = logical >= 0
                self.errors += int((got[v] != logical[v].float() * 10 + li).sum())
        return tc, tr, tf

    def prefill(self):
        import torch

        L, K, g = self.L, self.K, self.g
        for r in range(self.N):
            addrs = self.base[r] + torch.arange(L)
            self.st.begin_step([], {n: addrs for n in self.layers})
            self.write(addrs)
            pos = torch.randint(0, L, (L, K), generator=g)
            self._read(self.base[r] + pos, check=False)
        self.prev = torch.randint(0, L, (self.N, K), generator=g)
        self.step0, self.timers0 = self.st.step, self._timers()

    def _timers(self) -> dict:
        return {**self.st.time_s, **self.ex.time_s}

    def decode_step(self, s: int) -> None:
        import torch

        g, N, K = self.g, self.N, self.K
        n_ctx = self.L + s
        new = self.base + n_ctx
        fresh = torch.randint(0, n_ctx + 1, (N, K), generator=g)
        keep = torch.rand(N, K, generator=g) < self.args.reuse
        self.prev = torch.where(keep & (self.prev <= n_ctx), self.prev, fresh)
        self.prev[:, 0] = n_ctx  # the newest token
        logical = self.base.unsqueeze(1) + self.prev
        split0 = dict(self.split)
        w0 = time.perf_counter()
        t0 = CLOCK()
        self.st.begin_step([], {n: new for n in self.layers})
        t1 = CLOCK()
        inner = 0.0
        for k in SPLIT:
            d = self.split[k] - split0[k]
            self.times[k].append(d * 1e3)
            inner += d
        self.times["begin_rest"].append((t1 - t0 - inner) * 1e3)
        self.write(new)
        t2 = CLOCK()
        tc, tr, tf = self._read(logical, check=False)
        w1 = time.perf_counter()
        for k, v in (("begin", t1 - t0), ("kv_write", t2 - t1), ("candidates", tc),
                     ("resolve", tr), ("rows", tf), ("step", t2 - t0 + tc + tr + tf),
                     ("step_wall", w1 - w0)):
            self.times[k].append(v * 1e3)
        # Exactness, untimed: the same read again (resolve reuses the step's result).
        self._read_check(logical)

    def _read_check(self, logical):
        import torch

        for li, name in enumerate(self.layers):
            t = self.mods[name].impl.translator
            dev, staged = t.g.read  # this step's resolved read
            srcs = [self.st.host_rows[name]] if t.g.read_host else []
            if self.st.shard is not None and not self.st.replicas:
                srcs.append(t.g.fetched[name].view(torch.float32).view(-1, self.head)
                            if t.g.width else torch.empty(0, self.head))
            got = torch.full(logical.shape, -1.0)
            on = dev >= 0
            got[on] = self.mods[name].kv_cache.view(-1, self.head)[:, 0][dev[on]]
            for ids, rows in zip(staged, srcs):
                there = ids >= 0
                got[there] = rows.view(-1, self.head)[:, 0][ids[there]]
            v = logical >= 0
            self.errors += int((got[v] != logical[v].float() * 10 + li).sum())

    def summary(self) -> dict:
        w = self.args.warm
        out = {k: statistics.median(v[w:]) for k, v in self.times.items()}
        c = self.st.totals()
        out["errors"] = self.errors
        out["replicas"] = self.st.replicas
        out["remote_rows_fetched"] = c.get("remote_rows_fetched")
        out["remote_lookups"] = c.get("remote_lookups")
        out["remote_hits"] = c.get("remote_hits")
        out["gathers"] = self.ex.gathers
        # The product's own timers (wall, ms per decode step, every decode step).
        steps = max(1, self.st.step - self.step0)
        out["timers_ms"] = {k: round((v - self.timers0[k]) * 1e3 / steps, 4)
                            for k, v in self._timers().items()}
        return out


def rank_main(rank: int, args, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.cpus:
        os.sched_setaffinity(0, {args.cpus[rank % len(args.cpus)]})
    sys.path.insert(0, str(REPO))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.group.WORLD
    sims = {}
    if args.compare:
        sys.path.insert(0, str(HERE))
        from equal_batch_store import before_tree

        sys.path.insert(0, before_tree(args.compare, args.before_dir))
        sims["before"] = Sim("ulacache_before", args, rank, group)
    sims["after"] = Sim("ulacache_vllm", args, rank, group)
    for sim in sims.values():
        sim.prefill()
    prof = None
    if args.cprofile and rank == 0:
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
    if "before" in sims:
        w = args.warm
        res["paired_ratio_step"] = statistics.median(
            a / b for a, b in zip(sims["after"].times["step"][w:],
                                  sims["before"].times["step"][w:]))
        res["paired_ratio_wall"] = statistics.median(
            a / b for a, b in zip(sims["after"].times["step_wall"][w:],
                                  sims["before"].times["step_wall"][w:]))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run_pair(args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        mp.start_processes(rank_main, args=(args, init, d), nprocs=2, start_method="spawn")
        return [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--device-frac", type=float, default=0.75)
    ap.add_argument("--reuse", type=float, default=0.5)
    ap.add_argument("--warm", type=int, default=3, help="decode steps left out of the medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=3, help="runs (seeds)")
    ap.add_argument("--compare", default=None, metavar="REV",
                    help="a git revision: run its tree beside this one, step by step")
    ap.add_argument("--before-dir", default=None,
                    help="where the revision's tree is unpacked (default: /tmp/ula_tpx_<rev>)")
    ap.add_argument("--cpus", type=int, nargs="*", default=None,
                    help="pin rank r to CPU cpus[r %% len]")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile rank 0's timed decode steps, print the top N functions")
    ap.add_argument("--sort", default="tottime")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.compare:  # unpacked once, before the ranks start
        import subprocess

        args.compare = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.compare],
                                      capture_output=True, text=True, check=True).stdout.strip()
        if args.before_dir is None:
            args.before_dir = f"/tmp/ula_tpx_{args.compare[:12]}"
        sys.path.insert(0, str(HERE))
        from equal_batch_store import before_tree

        before_tree(args.compare, args.before_dir)
    doc = {"args": vars(args), "loadavg": os.getloadavg()}
    runs = []
    seed0 = args.seed
    for seed in range(seed0, seed0 + args.pairs):
        args.seed = seed
        runs.append(run_pair(args))
    args.seed = seed0
    doc["runs"] = runs
    sides = [k for k in ("before", "after") if k in runs[0][0]]
    print(f"TP=2 shard, {args.requests} x {args.prompt} + {args.steps}, {args.pairs} seeds, "
          f"sides alternating step by step; load {os.getloadavg()[0]:.1f}")
    print(f"{'phase':14s} " + " ".join(f"{sd}/r{r}".rjust(10) for sd in sides for r in (0, 1))
          + "   (ms/step; thread CPU except step_wall; median over seeds of per-run medians)")
    summary = {}
    for k in PHASES:
        vals = {f"{sd}/r{r}": statistics.median(run[r][sd][k] for run in runs)
                for sd in sides for r in (0, 1)}
        summary[k] = {n: round(v, 4) for n, v in vals.items()}
        print(f"{k:14s} " + " ".join(f"{v:10.3f}" for v in vals.values()))
    for sd in sides:
        r0 = runs[0][0][sd]
        print(f"{sd}: errors {sum(run[r][sd]['errors'] for run in runs for r in (0, 1))}, "
              f"rank 0 seed {seed0}: remote rows fetched {r0['remote_rows_fetched']}, "
              f"lookups {r0['remote_lookups']}, hits {r0['remote_hits']}, "
              f"gathers {r0['gathers']}, replicas {r0['replicas']}")
        for r in (0, 1):
            t = runs[0][r][sd]["timers_ms"]
            print(f"{sd} rank {r} product timers (ms per decode step, wall): "
                  + ", ".join(f"{k} {v:.3f}" for k, v in t.items() if v))
    if "before" in sides:
        for key in ("paired_ratio_step", "paired_ratio_wall"):
            pr = [run[r][key] for run in runs for r in (0, 1)]
            summary[key] = pr
            print(f"{key} after/before (per rank and seed): median {statistics.median(pr):.3f} "
                  f"[{min(pr):.3f}, {max(pr):.3f}]")
    doc["summary"] = summary
    doc["loadavg_end"] = os.getloadavg()
    sys.path.insert(0, str(HERE))
    from _host import cpu_host

    import subprocess

    doc["host"] = cpu_host()
    doc["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                   capture_output=True, text=True).stdout.strip()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
