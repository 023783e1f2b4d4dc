"""Arena vs split pools vs vLLM's uniform-page pool: concurrent requests under one byte budget.

For hybrid model shapes (GPT-OSS-20B, a Qwen3.5-4B-like GDN hybrid, Gemma 3 12B) and traffic
mixes, replays a backlog of requests first-come-first-served (each request reserves its peak
footprint at admission, frees it on completion) and reports the maximum and time-averaged
number of simultaneously admitted requests for:
  (a) split pools (one fixed pool per kind, natural page sizes) at SGLang's default ratio
      (swa_full_tokens_ratio=0.8, mamba_full_memory_ratio=0.9), at a bad ratio (0.1), and at
      the best ratio of a sweep chosen per mix with hindsight;
  (b) one pool of uniform pages as vLLM 0.32's hybrid manager builds it: vLLM's own
      get_kv_cache_groups + get_kv_cache_config_from_groups on the model's KV specs, then
      vLLM's per-type block rules (full: every block, SWA: window blocks, mamba: one block);
  (c) the arena (ulacache_vllm.arena), plus its bytes copied by compaction/relayout per
      admitted request.
Prints a table, writes benchmarks/results/arena_vs_split_pools.json and .png.

    python benchmarks/arena_vs_split_pools.py [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ulacache_vllm.arena import Arena, Band, KindSpec, RowSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _host, beside this script
from _host import cpu_host  # noqa: E402

GiB = 1 << 30
BLOCK = 16  # tokens per attention page (vLLM's default block size on GPU backends)
RESULTS = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------------------------------------
# Model shapes
@dataclass
class Model:
    name: str
    budget: int
    full_layers: int
    kv_heads: int
    head_dim: int
    swa_layers: int = 0
    window: int = 0
    gdn_layers: int = 0
    gdn_shapes: tuple = ()  # per-layer state tensor shapes
    dtype_bytes: int = 2

    @property
    def layer_token_bytes(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def gdn_layer_bytes(self) -> int:
        return sum(math.prod(s) for s in self.gdn_shapes) * self.dtype_bytes


def gdn_state_shapes(k_heads, v_heads, k_dim, v_dim, conv_kernel):
    # As vLLM's MambaStateShapeCalculator.gated_delta_net_state_shape (TP=1).
    conv_dim = k_heads * k_dim * 2 + v_heads * v_dim
    return ((conv_kernel - 1, conv_dim), (v_heads, v_dim, k_dim))


MODELS = [
    Model("gpt-oss-20b", 8 * GiB, full_layers=12, kv_heads=8, head_dim=64, swa_layers=12,
          window=128),
    Model("qwen3.5-4b-like", 8 * GiB, full_layers=8, kv_heads=4, head_dim=256, gdn_layers=24,
          gdn_shapes=gdn_state_shapes(16, 32, 128, 128, 4)),
    Model("gemma-3-12b", 16 * GiB, full_layers=8, kv_heads=8, head_dim=256, swa_layers=40,
          window=1024),
]


# ---------------------------------------------------------------------------------------------
# Traffic mixes: (prompt tokens, output tokens) in arrival order; all queued at t=0.
def mixes(quick: bool, seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    rng = np.random.default_rng(seed)
    s = 4 if quick else 1

    def short(n):
        return [(int(p), int(o)) for p, o in zip(rng.integers(256, 2048, n), rng.integers(64, 512, n))]

    return {
        "few-long": [(32768, 1024)] * (48 // s),
        "many-short": short(2400 // s),
        "shifting": short(600 // s) + [(32768, 1024)] * (24 // s) + short(600 // s)
        + [(32768, 1024)] * (24 // s),
        "long-gen": [(8192, 32768)] * (64 // s),
    }


def duration(p: int, o: int) -> float:
    return o + p / 1024  # decode steps plus chunked prefill steps


# ---------------------------------------------------------------------------------------------
# Allocators: each answers try_admit(p, o) -> handle | None and release(handle).
def natural_pages(m: Model, tokens: int) -> dict[str, int]:
    d = {"full": -(-tokens // BLOCK)}
    if m.swa_layers:
        d["swa"] = min(-(-tokens // BLOCK), -(-(m.window - 1) // BLOCK) + 1)
    if m.gdn_layers:
        d["state"] = 1
    return d


def arena_kinds(m: Model) -> list[KindSpec]:
    dt = "bfloat16"
    kinds = [KindSpec("full", Band.HIGH, tuple(RowSpec(f"full{i}", (2, m.kv_heads, m.head_dim), dt)
                                               for i in range(m.full_layers)), BLOCK)]
    if m.swa_layers:
        kinds.append(KindSpec("swa", Band.LOW, tuple(RowSpec(f"swa{i}", (2, m.kv_heads, m.head_dim), dt)
                                                     for i in range(m.swa_layers)), BLOCK))
    if m.gdn_layers:
        kinds.append(KindSpec("state", Band.LOW, tuple(RowSpec(f"gdn{i}.{j}", s, dt)
                                                       for i in range(m.gdn_layers)
                                                       for j, s in enumerate(m.gdn_shapes)), 1))
    return kinds


class ArenaAlloc:
    def __init__(self, m: Model):
        self.m = m
        self.arena = Arena(m.budget, arena_kinds(m), alignment=4096)
        self.n = 0

    def try_admit(self, p, o):
        self.n += 1
        res = self.arena.admit(self.n, natural_pages(self.m, p + o))
        # A worker would execute res.copy_plan here; only its size matters for this benchmark.
        return self.n if res.ok else None

    def release(self, h):
        self.arena.free(h)


class SplitAlloc:
    """One fixed pool per kind, each in its natural page size; ``ratio`` as in SGLang."""

    def __init__(self, m: Model, ratio: float):
        kinds = arena_kinds(m)
        self.page = {k.name: k.natural_page_bytes for k in kinds}
        full_tok = m.full_layers * m.layer_token_bytes
        if m.swa_layers:  # swa_full_tokens_ratio: SWA pool tokens = ratio * full pool tokens
            swa_tok = m.swa_layers * m.layer_token_bytes
            full_tokens = m.budget / (full_tok + ratio * swa_tok)
            self.free = {"full": int(full_tokens // BLOCK),
                         "swa": int(ratio * full_tokens // BLOCK)}
        else:  # mamba_full_memory_ratio: state bytes = ratio * full KV bytes
            full_bytes = m.budget / (1 + ratio)
            self.free = {"full": int(full_bytes // self.page["full"]),
                         "state": int((m.budget - full_bytes) // self.page["state"])}
        self.m = m

    def try_admit(self, p, o):
        d = natural_pages(self.m, p + o)
        if all(self.free[k] >= n for k, n in d.items()):
            for k, n in d.items():
                self.free[k] -= n
            return d
        return None

    def release(self, d):
        for k, n in d.items():
            self.free[k] += n


class UniformPoolAlloc:
    """vLLM 0.32 hybrid manager: groups and block count from vLLM's own sizing functions."""

    def __init__(self, m: Model):
        cfg = vllm_uniform_pool(m)
        self.free = cfg["num_blocks"] - 1  # BlockPool keeps block 0 as the null block
        self.groups = cfg["groups"]
        self.info = cfg
        self.m = m

    def blocks_for(self, tokens: int) -> int:
        n = 0
        for kind, bs, window in self.groups:
            if kind == "full":
                n += -(-tokens // bs)
            elif kind == "swa":  # SlidingWindowManager keeps only the blocks the window touches
                n += min(-(-tokens // bs), -(-(window - 1) // bs) + 1)
            else:  # MambaManager, mamba_cache_mode="none": one state block per request
                n += 1
        return n

    def try_admit(self, p, o):
        n = self.blocks_for(p + o)
        if n <= self.free:
            self.free -= n
            return n
        return None

    def release(self, n):
        self.free += n


def vllm_uniform_pool(m: Model) -> dict:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, SlidingWindowSpec)

    vc = VllmConfig()
    vc.cache_config.kv_cache_layout = "LBHNC"  # layer-outer: the uniform-page-size path
    block = BLOCK
    attn_1tok = FullAttentionSpec(block_size=1, num_kv_heads=m.kv_heads, head_size=m.head_dim,
                                  dtype=torch.bfloat16).page_size_bytes
    if m.gdn_layers:
        # Config-time step of vLLM (Platform._align_hybrid_block_size, which needs a model
        # class): raise the attention block until its page >= the mamba page; the mamba page
        # is then padded to it.
        mamba_page = MambaSpec(block_size=-1, shapes=m.gdn_shapes,
                               dtypes=(torch.bfloat16,) * len(m.gdn_shapes)).page_size_bytes
        block = BLOCK * -(-mamba_page // (BLOCK * attn_1tok))
    specs, order = {}, []
    n_layers = m.full_layers + m.swa_layers + m.gdn_layers
    other = m.swa_layers or m.gdn_layers
    step = n_layers / m.full_layers
    full_idx = {int(round(i * step + step - 1)) for i in range(m.full_layers)}
    assert len(full_idx) == m.full_layers and other == n_layers - m.full_layers
    for i in range(n_layers):
        name = f"model.layers.{i}.attn"
        if i in full_idx:
            specs[name] = FullAttentionSpec(block_size=block, num_kv_heads=m.kv_heads,
                                            head_size=m.head_dim, dtype=torch.bfloat16)
        elif m.swa_layers:
            specs[name] = SlidingWindowSpec(block_size=block, num_kv_heads=m.kv_heads,
                                            head_size=m.head_dim, dtype=torch.bfloat16,
                                            sliding_window=m.window)
        else:
            specs[name] = MambaSpec(block_size=block, shapes=m.gdn_shapes,
                                    dtypes=(torch.bfloat16,) * len(m.gdn_shapes))
        order.append(name)
    groups = get_kv_cache_groups(vc, specs)
    cfg = get_kv_cache_config_from_groups(vc, groups, m.budget)
    out = []
    for g in groups:
        s = g.kv_cache_spec
        kind = ("swa" if isinstance(s, SlidingWindowSpec) else
                "mamba" if isinstance(s, MambaSpec) else "full")
        out.append((kind, s.block_size, getattr(s, "sliding_window", 0) or 0))
    page = cfg.kv_cache_tensors[0].size // cfg.num_blocks if cfg.kv_cache_tensors else 0
    return {"num_blocks": cfg.num_blocks, "groups": out, "block_size": block,
            # What one block id of the shared pool stands for. (Summing the tensors' sizes would
            # count bytes several times: vLLM's hybrid layout shares them across the groups.)
            "bytes_per_block": m.budget // max(cfg.num_blocks, 1),
            "group_layers": [len(g.layer_names) for g in groups], "tensor0_block": page}


# ---------------------------------------------------------------------------------------------
def replay(alloc, reqs: list[tuple[int, int]]) -> dict:
    """FCFS backlog replay; returns max / time-averaged concurrency and what was never admitted."""
    t, i, running, peak, area, rejected = 0.0, 0, [], 0, 0.0, 0
    seq = 0
    while i < len(reqs) or running:
        while i < len(reqs):
            p, o = reqs[i]
            h = alloc.try_admit(p, o)
            if h is None:
                if not running:  # cannot fit even alone: drop, as an engine would reject it
                    rejected += 1
                    i += 1
                    continue
                break
            heapq.heappush(running, (t + duration(p, o), seq, h))
            seq += 1
            i += 1
        peak = max(peak, len(running))
        if not running:
            continue
        nt = running[0][0]
        area += len(running) * (nt - t)
        t = nt
        while running and running[0][0] <= t:
            alloc.release(heapq.heappop(running)[2])
    return {"max_concurrent": peak, "mean_concurrent": round(area / t, 2) if t else 0.0,
            "makespan": round(t, 1), "rejected": rejected}


RATIO_SWEEP = [round(x, 4) for x in np.geomspace(0.02, 50, 25)]


def run(quick: bool) -> dict:
    out = {"block_size": BLOCK, "models": {}}
    mix = mixes(quick)
    for m in MODELS:
        uni_info = vllm_uniform_pool(m)
        mres = {"budget_bytes": m.budget, "vllm_uniform_pool": uni_info, "mixes": {}}
        for name, reqs in mix.items():
            t0 = time.perf_counter()
            default = 0.8 if m.swa_layers else 0.9
            # The sweep includes the two ratios shown on their own, so "best" is at least both.
            sweep = {r: replay(SplitAlloc(m, r), reqs) for r in sorted({*RATIO_SWEEP, default, 0.1})}
            row = {"default_split": sweep[default], "bad_split_0.1": sweep[0.1]}
            best_r = max(sweep, key=lambda r: (sweep[r]["max_concurrent"], sweep[r]["mean_concurrent"]))
            row["best_split"] = dict(sweep[best_r], ratio=best_r)
            row["vllm_uniform"] = replay(UniformPoolAlloc(m), reqs)
            aa = ArenaAlloc(m)
            row["arena"] = replay(aa, reqs)
            st = aa.arena.stats
            row["arena"].update(bytes_copied=st["bytes_copied"], admitted=st["admitted"],
                                copied_bytes_per_admit=round(st["bytes_copied"] / max(st["admitted"], 1)),
                                compactions=st["compactions"], relayouts=st["relayouts"])
            row["seconds"] = round(time.perf_counter() - t0, 2)
            mres["mixes"][name] = row
        out["models"][m.name] = mres
    return out


SYSTEMS = [("default_split", "split default"), ("bad_split_0.1", "split 0.1"),
           ("best_split", "split best"), ("vllm_uniform", "vLLM uniform"), ("arena", "arena")]


def table(res: dict) -> str:
    hdr = (f"{'model':<17}{'mix':<12}" + "".join(f"{lbl:>15}" for _, lbl in SYSTEMS)
           + f"{'arena/default':>14}{'arena/best':>11}{'copied/adm':>12}")
    lines = ["max simultaneously admitted requests (mean in parentheses)", hdr, "-" * len(hdr)]
    for mn, mres in res["models"].items():
        for xn, row in mres["mixes"].items():
            cells = "".join(f"{row[k]['max_concurrent']:>7} ({row[k]['mean_concurrent']:>5.0f})"
                            for k, _ in SYSTEMS)
            a, d, b = (row[k]["max_concurrent"] for k in ("arena", "default_split", "best_split"))
            lines.append(f"{mn:<17}{xn:<12}{cells}{a / max(d, 1):>13.2f}x{a / max(b, 1):>10.2f}x"
                         f"{row['arena']['copied_bytes_per_admit'] / 2**20:>9.2f}MiB")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(res["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    for ax, mn in zip(np.atleast_1d(axes), models):
        mixes_ = list(res["models"][mn]["mixes"])
        x = np.arange(len(mixes_))
        w = 0.8 / len(SYSTEMS)
        for j, (k, lbl) in enumerate(SYSTEMS):
            ax.bar(x + j * w, [res["models"][mn]["mixes"][mx][k]["max_concurrent"] for mx in mixes_],
                   w, label=lbl)
        ax.set_xticks(x + 0.4 - w / 2, mixes_, fontsize=8)
        ax.set_title(f"{mn} ({res['models'][mn]['budget_bytes'] // GiB} GiB)")
        ax.set_ylabel("max concurrent requests")
        ax.set_yscale("log")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests (< 1 min)")
    ap.add_argument("--out", default=str(RESULTS), help="results directory")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args.quick)
    res["quick"] = args.quick
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["host"] = cpu_host()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "arena_vs_split_pools" + ("_quick" if args.quick else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot(res, out / f"{stem}.png")
    print(table(res))
    print(f"wrote {out / (stem + '.json')} and .png in {res['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
