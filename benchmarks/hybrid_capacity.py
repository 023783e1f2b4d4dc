"""Hybrid capacity benchmark: stock vLLM's CPU HMA against the ulacache arena, same byte budget.

Hybrid models (tiny Qwen3-Next: GDN state + full attention; tiny GPT-OSS: sliding window + full
attention) in the real engine, on the seed's workload shapes scaled 1/8 to the tiny models, at
one KV byte budget (``kv_cache_memory_bytes``), three configurations, each engine in its own
subprocess (this script re-invoked with ``--worker``):

  stock        stock vLLM, default block size (GDN hybrids: vLLM raises the attention block
               until an attention page holds a state page and pads the state pages to it)
  stock-bs32   stock vLLM with ``block_size=32``. On GDN hybrids vLLM overrides it too
               (``Platform._align_hybrid_block_size``: the smallest multiple of 32 whose page
               holds a state page, 160 tokens for the benchmark's Qwen3-Next), which still beats
               the default (256); on GPT-OSS it is honoured.
  ulacache     ``kv_backend="ulacache"``: one arena, 32-token attention pages, state pages of
               exactly the state's bytes

Shapes (prompt / output tokens x requests @ concurrency; a new request is added as one
finishes): ``long_in`` 2048/512 x64 @64 (seed 16K/4K), ``short`` 128/32 x256 all at once (seed
1K/256), ``long_out`` 64/2048 x64 @64 (seed 512/16K), plus ``sched64`` 64/128 x64 @64, which
keeps ~64 requests running to time the scheduler. Prompts are random token ids (no shared
prefixes); prefix caching is off in every configuration (ulacache does not do it).

Per shape and config: peak and mean running requests, preemptions per 1000 completed requests,
output tok/s, mean TTFT, and for ulacache the arena's moves (compactions, relayouts, pages
moved, bytes copied) per admitted request. The engine core runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the worker wraps the scheduler's ``schedule()``, the KV
manager's ``allocate_slots`` and the arena's ``allocate`` (the ladder: reuse -> compact ->
relayout) with timers and counts preemptions at ``_preempt_request``: the per-step cost of
the ladder is reported at ~64 running requests, against stock's ``schedule()``.

    python benchmarks/hybrid_capacity.py --quick      # ~10 minutes on 2 cores
    python benchmarks/hybrid_capacity.py              # the full grid (much longer)

Prints a table, writes ``results/hybrid_capacity[_quick].json`` and a PNG beside it.
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

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
MARK = "@@HYBRID_CAPACITY@@"
MiB = 1 << 20

# Tiny models: Qwen3-Next with 8 heads / 8 KV heads (one GDN state of its 3 linear layers,
# 804,864 B, holds as many bytes as ~393 tokens of its attention KV, 2,048 B/token: Qwen3-Next's
# ratio at 1/8 scale; the stock tiny model's 2 KV heads overstate it 4x) in bf16, the dtype
# vLLM's CPU GDN kernels need; GPT-OSS in float32 with initializer_range 0.1 (non-flat output).
MODELS = {
    "qwen3_next": dict(dir="bench-qwen3-next-h8", dtype="bfloat16",
                       overrides=dict(num_attention_heads=8, num_key_value_heads=8)),
    "gpt_oss": dict(dir="bench-gpt-oss", dtype="float32",
                    overrides=dict(initializer_range=0.1)),
}

# name: (prompt tokens, output tokens, requests, concurrency)
SHAPES_FULL = {
    "long_in": (2048, 512, 64, 64),
    "short": (128, 32, 256, 256),
    "long_out": (64, 2048, 64, 64),
    "sched64": (64, 128, 64, 64),
}
SHAPES_QUICK = {
    "long_in": (1024, 256, 40, 40),
    "short": (128, 32, 160, 160),
    "long_out": (64, 1024, 48, 48),
    "sched64": (64, 96, 64, 64),
}
# One byte budget per model and mode, ~25 stock-default max_model_len footprints for Qwen3-Next
# (stock default: 256-token blocks of 512 KiB, a max-length request holds max_model_len/256
# attention blocks + 3 state blocks: 9.5 MiB at 4096, 5.5 MiB at 2048) and about as many short
# requests for GPT-OSS; small enough that the short shape saturates every configuration.
BUDGETS = {
    ("qwen3_next", False): 240 * MiB,
    ("qwen3_next", True): 136 * MiB,
    ("gpt_oss", False): 170 * MiB,
    ("gpt_oss", True): 64 * MiB,
}
CONFIGS = {
    "stock": dict(backend="vllm", block_size=None),
    "stock-bs32": dict(backend="vllm", block_size=32),
    "ulacache": dict(backend="ulacache", block_size=None),
}


# ----------------------------------------------------------------------------- worker side
def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _worker(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams
    import numpy as np

    kw = dict(kv_backend=cfg["backend"], kv_cache_memory_bytes=cfg["kv_bytes"])
    if cfg["block_size"]:
        kw["block_size"] = cfg["block_size"]
    if cfg.get("spec"):  # --spec: the same speculative settings for every config
        kw.update(speculative_config=cfg["spec"], disable_log_stats=False)
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              enable_prefix_caching=False, **kw)

    def spec_counts():
        if not cfg.get("spec"):
            return None
        return {m.name[len("vllm:spec_decode_"):]: m.value for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                              "vllm:spec_decode_num_accepted_tokens")}
    eng = llm.llm_engine
    sch = eng.engine_core.engine_core.scheduler  # in-process engine core
    kvm = sch.kv_cache_manager
    arena = getattr(kvm, "arena", None)

    # Timers: one record per schedule() call.
    cur = {"alloc_s": 0.0, "alloc_calls": 0, "ladder_s": 0.0, "ladder_calls": 0,
           "preempt": 0}
    steps: list[tuple] = []
    orig_schedule, orig_alloc, orig_preempt = sch.schedule, kvm.allocate_slots, \
        sch._preempt_request

    def schedule(*a, **k):
        cur["alloc_s"] = cur["ladder_s"] = 0.0
        cur["alloc_calls"] = cur["ladder_calls"] = 0
        t = time.perf_counter()
        out = orig_schedule(*a, **k)
        dt = time.perf_counter() - t
        steps.append((len(sch.running), dt, cur["alloc_s"], cur["alloc_calls"],
                      cur["ladder_s"], cur["ladder_calls"]))
        return out

    def timed(fn, key):  # fn, adding its time and calls to this step's counters
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                cur[f"{key}_s"] += time.perf_counter() - t
                cur[f"{key}_calls"] += 1

        return wrapper

    def preempt(*a, **k):
        cur["preempt"] += 1
        return orig_preempt(*a, **k)

    sch.schedule, sch._preempt_request = schedule, preempt
    kvm.allocate_slots = timed(orig_alloc, "alloc")
    if arena is not None:
        arena.allocate = timed(arena.allocate, "ladder")

    def arena_stats():
        return dict(kvm.stats()) if arena is not None else None

    from _host import engine_path

    cc = eng.vllm_config.cache_config
    res = {"name": cfg["name"], "block_size": cc.block_size,
           "engine_path": engine_path(llm),
           "kv_groups": [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size,
                          g.kv_cache_spec.page_size_bytes, len(g.layer_names))
                         for g in sch.kv_cache_config.kv_cache_groups],
           "num_blocks": sch.kv_cache_config.num_blocks, "shapes": {}}
    if arena is not None:
        res["arena_total_bytes"] = kvm.layout.total_bytes
        res["arena_summary"] = kvm.layout.summary()
    rng = np.random.default_rng(0)
    vocab = 1000  # tiny models' vocab is 1024; stay clear of the special ids at the top
    # Warm-up (every config alike): first-use costs of kernels and paths stay out of the shapes.
    llm.generate([{"prompt_token_ids": rng.integers(10, vocab, n).tolist()}
                  for n in (16, 128, 300, 700) * 4],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    vocab = 1000  # tiny models' vocab is 1024; stay clear of the special ids at the top
    for shape, (p_len, o_len, n_req, conc) in cfg["shapes"].items():
        prompts = [rng.integers(10, vocab, p_len).tolist() for _ in range(n_req)]
        sp = SamplingParams(temperature=0, max_tokens=o_len, ignore_eos=True)
        steps.clear()
        cur["preempt"] = 0
        a0, s0 = arena_stats(), spec_counts()
        added, first, done, out_tokens = {}, {}, 0, 0
        nxt = 0
        step_s: list[float] = []
        t0 = time.perf_counter()
        error = None
        try:
            while done < n_req:
                while nxt < n_req and nxt - done < conc:
                    rid = f"{shape}-{nxt}"
                    eng.add_request(rid, {"prompt_token_ids": prompts[nxt]}, sp)
                    added[rid] = time.perf_counter()
                    nxt += 1
                ts = time.perf_counter()
                outs = eng.step()
                now = time.perf_counter()
                step_s.append(now - ts)
                for o in outs:
                    if o.request_id not in first and len(o.outputs[0].token_ids) > 0:
                        first[o.request_id] = now - added[o.request_id]
                    if o.finished:
                        done += 1
                        out_tokens += len(o.outputs[0].token_ids)
                if time.perf_counter() - t0 > cfg["shape_timeout"]:
                    raise TimeoutError(f"{shape} exceeded {cfg['shape_timeout']} s "
                                       f"({done}/{n_req} done)")
        except Exception as e:  # keep the other shapes' figures; report this one's error
            import traceback

            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
        wall = time.perf_counter() - t0
        a1 = arena_stats()
        busy = [s for s in steps if s[0] > 0]
        run = [s[0] for s in busy]
        r = {"prompt": p_len, "output": o_len, "requests": n_req, "concurrency": conc,
             "completed": done, "wall_s": wall, "steps": len(steps),
             "peak_running": max(run, default=0),
             "mean_running": statistics.fmean(run) if run else 0.0,
             "preemptions": cur["preempt"],
             "preemptions_per_1000": 1000 * cur["preempt"] / max(1, done),
             "output_tok_s": out_tokens / wall,
             "ttft_mean_s": statistics.fmean(first.values()) if first else None,
             "ttft_p50_s": _pct(list(first.values()), 0.5),
             "step_ms_median": 1000 * statistics.median(step_s) if step_s else None,
             "step_s_total": sum(step_s),
             "step_ms_top5": sorted((round(1000 * t, 1), i) for i, t in enumerate(step_s))[-5:],
             "error": error}
        # Scheduler cost per step (all non-empty steps, and those with 56-72 running).
        def cost(sel):
            if not sel:
                return None
            return {"steps": len(sel), "mean_running": statistics.fmean(s[0] for s in sel),
                    "schedule_us_median": 1e6 * statistics.median(s[1] for s in sel),
                    "schedule_us_mean": 1e6 * statistics.fmean(s[1] for s in sel),
                    "allocate_slots_us_median": 1e6 * statistics.median(s[2] for s in sel),
                    "allocate_slots_calls_mean": statistics.fmean(s[3] for s in sel),
                    "ladder_us_median": 1e6 * statistics.median(s[4] for s in sel),
                    "ladder_us_mean": 1e6 * statistics.fmean(s[4] for s in sel),
                    "ladder_calls_mean": statistics.fmean(s[5] for s in sel)}
        if s0 is not None:  # drafts judged in this shape, and the acceptance rate
            sd = {k: v - s0.get(k, 0) for k, v in spec_counts().items()}
            sd["acceptance"] = sd["num_accepted_tokens"] / max(1, sd["num_draft_tokens"])
            r["spec_decode"] = sd
        r["sched_all"] = cost(busy)
        r["sched_at_64"] = cost([s for s in busy if 56 <= s[0] <= 72])
        if a0 is not None:
            admitted = n_req + cur["preempt"]  # every preemption is one more admission
            mv = {k: a1[f"arena_{k}"] - a0[f"arena_{k}"]
                  for k in ("compactions", "relayouts", "pages_moved", "bytes_copied",
                            "shortfalls")}
            r["arena_moves"] = mv
            r["admitted"] = admitted
            r["arena_moves_per_admitted"] = {k: v / max(1, admitted) for k, v in mv.items()}
            r["arena_end"] = {k: a1[k] for k in ("arena_used_bytes", "arena_withheld_bytes",
                                                  "arena_live_pages")}
        res["shapes"][shape] = r
        print(f"[{cfg['name']}] {shape}: {json.dumps({k: r[k] for k in ('completed', 'wall_s', 'peak_running', 'mean_running', 'preemptions', 'output_tok_s')})}",
              file=sys.stderr, flush=True)
    if arena is not None:
        res["usage_rpc"] = {k: v for k, v in llm.collective_rpc("ulacache_usage")[0].items()
                            if k.startswith("arena_")}
    return res


# ----------------------------------------------------------------------------- driver side
def _spawn(cfg: dict) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # conflicts with kv_cache_memory_bytes
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in-process: scheduler access
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                                    str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=cfg["timeout"])
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["process_s"] = time.perf_counter() - t
            res["stderr_tail"] = out.stderr[-1500:] if any(
                s.get("error") for s in res["shapes"].values()) else ""
            return res
    return {"name": cfg["name"], "failed": True,
            "stderr_tail": out.stderr[-6000:], "stdout_tail": out.stdout[-2000:]}


def _model_path(name: str, mtp: bool = False) -> str:
    from ulacache_vllm.models import build_model

    m = MODELS[name]
    overrides = dict(m["overrides"], **({"num_nextn_predict_layers": 1} if mtp else {}))
    path = REPO / "models_cache" / (m["dir"] + ("-mtp" if mtp else ""))
    if not (path / "config.json").exists():
        build_model(name, path, overrides=overrides)
    return str(path)


def _spec_config(arg: str | None) -> dict | None:
    """``--spec METHOD[:K]`` as vLLM's speculative_config (None without one)."""
    from _spec import spec_config

    return spec_config(arg) or None


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def _table(model: str, results: dict, shapes: list[str]) -> list[str]:
    names = [n for n in CONFIGS if n in results]
    lines = [f"\n== {model} ==  (config: " + ", ".join(
        f"{n} block {results[n].get('block_size')}" for n in names if not results[n].get("failed"))
        + ")"]
    hdr = f"{'shape':<9} {'metric':<22}" + "".join(f"{n:>13}" for n in names)
    lines.append(hdr)
    rows = [("peak running", "peak_running", "d"), ("mean running", "mean_running", ".1f"),
            ("preempt / 1000 done", "preemptions_per_1000", ".0f"),
            ("output tok/s", "output_tok_s", ".0f"), ("mean TTFT s", "ttft_mean_s", ".2f"),
            ("median step ms", "step_ms_median", ".1f"),
            ("completed", "completed", "d")]
    for s in shapes:
        for label, key, spec in rows:
            vals = []
            for n in names:
                r = results[n]
                sh = None if r.get("failed") else r["shapes"].get(s)
                vals.append(_fmt(sh.get(key) if sh else None, spec))
            lines.append(f"{s:<9} {label:<22}" + "".join(f"{v:>13}" for v in vals))
        u = results.get("ulacache", {}).get("shapes", {}).get(s)
        if u and "arena_moves_per_admitted" in u:
            m = u["arena_moves_per_admitted"]
            lines.append(f"{s:<9} {'arena per admitted':<22} compactions {m['compactions']:.3f}, "
                         f"relayouts {m['relayouts']:.3f}, pages moved {m['pages_moved']:.2f}, "
                         f"bytes copied {m['bytes_copied'] / 1024:.1f} KiB "
                         f"({u['admitted']} admissions)")
        for n in names:
            sh = results[n].get("shapes", {}).get(s) if not results[n].get("failed") else None
            if sh and sh.get("error"):
                lines.append(f"{s:<9} ERROR in {n}: {sh['error'].strip().splitlines()[-1]}")
    return lines


def _ladder_lines(model: str, results: dict) -> list[str]:
    lines = [f"\n-- {model}: scheduler cost per step at 56-72 running requests (sched64 shape; "
             "median us) --"]
    base = {}
    for n in CONFIGS:
        r = results.get(n)
        if not r or r.get("failed"):
            continue
        c = r["shapes"].get("sched64", {}).get("sched_at_64")
        if not c:
            # fall back to any shape with steps at ~64 running
            cands = [sh["sched_at_64"] for sh in r["shapes"].values() if sh.get("sched_at_64")]
            c = max(cands, key=lambda x: x["steps"]) if cands else None
        if not c:
            lines.append(f"{n:<11} no steps with 56-72 running")
            continue
        base[n] = c["schedule_us_median"]
        extra = (f", arena.allocate (ladder) {c['ladder_us_median']:.0f} us median / "
                 f"{c['ladder_us_mean']:.0f} mean, {c['ladder_calls_mean']:.1f} calls"
                 if n == "ulacache" else "")
        lines.append(f"{n:<11} schedule() {c['schedule_us_median']:.0f} us "
                     f"(mean {c['schedule_us_mean']:.0f}), allocate_slots "
                     f"{c['allocate_slots_us_median']:.0f} us in {c['allocate_slots_calls_mean']:.1f} "
                     f"calls{extra}; {c['steps']} steps, mean running {c['mean_running']:.1f}")
    if "ulacache" in base:
        for n in ("stock", "stock-bs32"):
            if n in base:
                lines.append(f"schedule() ulacache / {n}: {base['ulacache'] / base[n]:.2f}x")
    return lines


def _natural_bytes(results: dict, shape: tuple, window: int | None) -> int | None:
    """Bytes one request of ``shape`` holds at its final length (prompt + output) with nothing
    padded or reserved: each GDN layer's state once, full-attention KV per token, sliding KV
    per token of its last ``window`` tokens. From the arena's kv groups (natural page sizes:
    exact state pages, per-token attention pages); None when the arena did not run."""
    r = results.get("ulacache")
    if not r or r.get("failed"):
        return None
    T = shape[0] + shape[1]
    total = 0
    for kind, block, page, layers in r["kv_groups"]:
        if kind == "MambaSpec":
            total += page * layers
        elif kind == "SlidingWindowSpec":
            total += page // block * layers * min(T, window or T)
        else:
            total += page // block * layers * T
    return total


def _targets(results: dict, shapes: dict | None = None, kv_bytes: int | None = None,
             window: int | None = None) -> list[str]:
    out = []
    r = {n: results[n] for n in CONFIGS if n in results and not results[n].get("failed")}
    if len(r) < 3:
        return ["targets: not all configurations ran"]
    sh = lambda n, s: r[n]["shapes"].get(s) or {}
    s_stock = sh("stock", "short").get("peak_running")
    s_bs = sh("stock-bs32", "short").get("peak_running")
    s_ula = sh("ulacache", "short").get("peak_running")
    if s_stock and s_ula:
        better = max(s_stock, s_bs or 0)
        out.append(f"short shape peak running: ulacache {s_ula} = {s_ula / s_stock:.2f}x stock "
                   f"({s_stock}), {s_ula / max(1, s_bs or 0):.2f}x stock-bs32 ({s_bs}); target "
                   f">= the better stock ({better}): "
                   f"{'met' if s_ula >= better else 'NOT met'}")
    lo = {n: sh(n, "long_out").get("preemptions_per_1000") for n in r}
    if all(v is not None for v in lo.values()):
        better = lo["ulacache"] < min(lo["stock"], lo["stock-bs32"]) or \
            lo["ulacache"] == 0 == min(lo["stock"], lo["stock-bs32"])
        out.append(f"long_out preemptions / 1000: " + ", ".join(f"{n} {v:.0f}"
                                                                for n, v in lo.items())
                   + f"; fewer than stock: {'met' if lo['ulacache'] < lo['stock'] else 'NOT met'}"
                   + f", than the better stock: {'met' if better else 'NOT met'}")
    for s in ("long_in", "short", "long_out"):
        if not any(sh(n, s) for n in r):
            continue
        best = max((sh(n, s).get("peak_running") or 0) for n in ("stock", "stock-bs32"))
        u = sh("ulacache", s).get("peak_running") or 0
        best_tok = max((sh(n, s).get("output_tok_s") or 0) for n in ("stock", "stock-bs32"))
        u_tok = sh("ulacache", s).get("output_tok_s") or 0
        line = (f"{s}: ulacache peak {u} vs better stock {best} "
                f"({'>=' if u >= best else 'BELOW'}); tok/s {u_tok:.0f} vs {best_tok:.0f} "
                f"({u_tok / max(best_tok, 1e-9):.2f}x)")
        nat = _natural_bytes(results, shapes[s], window) if shapes and s in shapes else None
        if nat and kv_bytes:
            bound = kv_bytes // nat
            line += (f"; physical bound {bound} (budget / {nat:,} natural B per request at "
                     f"{shapes[s][0] + shapes[s][1]} tokens; the shape runs at most "
                     f"{shapes[s][3]}): ulacache {u / bound:.2f}, better stock "
                     f"{best / bound:.2f} of it")
        out.append(line)
    return out


def _plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("peak_running", "peak running requests"),
               ("mean_running", "mean running requests"),
               ("preemptions_per_1000", "preemptions / 1000 completed"),
               ("output_tok_s", "output tokens / s"), ("ttft_mean_s", "mean TTFT (s)")]
    models = list(all_results)
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(4 * len(metrics),
                                                                   3.4 * len(models)),
                             squeeze=False)
    colors = {"stock": "#999", "stock-bs32": "#555", "ulacache": "#2a7"}
    for i, model in enumerate(models):
        res = all_results[model]["results"]
        shapes = [s for s in all_results[model]["shapes"] if s != "sched64"]
        for j, (key, title) in enumerate(metrics):
            ax = axes[i][j]
            w = 0.8 / len(CONFIGS)
            for k, n in enumerate(CONFIGS):
                r = res.get(n, {})
                vals = [((r.get("shapes") or {}).get(s) or {}).get(key) or 0 for s in shapes]
                ax.bar([x + (k - 1) * w for x in range(len(shapes))], vals, w, label=n,
                       color=colors[n])
            ax.set_xticks(range(len(shapes)), shapes)
            ax.set_title(f"{model}: {title}", fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help="max_model_len 2048, fewer/shorter requests; GPT-OSS short shape only")
    ap.add_argument("--models", default="qwen3_next,gpt_oss")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", default=None, help="comma list (default: all for Qwen3-Next; "
                    "GPT-OSS: short only with --quick)")
    ap.add_argument("--kv-bytes", type=int, default=None, help="override the byte budget")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--spec", default=None, metavar="METHOD[:K]",
                    help="speculative decoding for every config: ngram[:k] (default k 3) or "
                    "mtp[:k] (Qwen3-Next's own MTP layer: a model built with one; default 2); "
                    "results in <out>_spec_<method>")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--report", metavar="JSON",
                    help="print the targets (with the physical bound) of a saved run; run nothing")
    args = ap.parse_args()
    if args.report:
        doc = json.loads(Path(args.report).read_text())
        for model, m in doc["models"].items():
            window = json.loads((Path(_model_path(model)) / "config.json").read_text()).get(
                "sliding_window")
            print(f"{model}:")
            for t in _targets(m["results"], m["shapes"], m["kv_bytes"], window):
                print("  " + t)
        return
    if args.worker:
        res = _worker(json.loads(args.worker))
        print(MARK + json.dumps(res), flush=True)
        return
    quick = args.quick
    max_model_len = 2048 if quick else 4096
    all_shapes = SHAPES_QUICK if quick else SHAPES_FULL
    out = Path(args.out) / ("hybrid_capacity_quick" if quick else "hybrid_capacity")
    spec = _spec_config(args.spec)
    if spec:
        out = out.with_name(f"{out.name}_spec_{spec['method']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    from _host import cpu_host

    doc = {"args": vars(args), "host": cpu_host(), "max_model_len": max_model_len, "models": {}}
    lines_all: list[str] = []
    for model in args.models.split(","):
        if args.shapes:
            names = args.shapes.split(",")
        elif model == "gpt_oss" and quick:
            names = ["short"]
        else:
            names = list(all_shapes)
        shapes = {s: all_shapes[s] for s in names}
        budget = args.kv_bytes or BUDGETS[(model, quick)]
        path = _model_path(model, mtp=bool(spec) and spec["method"] == "mtp")
        results = {}
        for name in args.configs.split(","):
            cfg = dict(CONFIGS[name], name=name, model=path, dtype=MODELS[model]["dtype"],
                       kv_bytes=budget, max_model_len=max_model_len,
                       max_num_seqs=args.max_num_seqs, shapes=shapes, spec=spec,
                       shape_timeout=900 if quick else 3600, timeout=3600 if quick else 14400)
            print(f"running {model} / {name} ...", flush=True)
            results[name] = _spawn(cfg)
            if results[name].get("failed"):
                print(f"  FAILED:\n{results[name]['stderr_tail']}", flush=True)
            else:
                print(f"  done in {results[name]['process_s']:.0f} s", flush=True)
        doc["models"][model] = {"kv_bytes": budget, "dtype": MODELS[model]["dtype"],
                                "overrides": MODELS[model]["overrides"], "shapes": shapes,
                                "results": results}
        lines = [f"\n##### {model} ({MODELS[model]['dtype']}), KV budget {budget} B "
                 f"({budget / MiB:.0f} MiB), max_model_len {max_model_len}, max_num_seqs "
                 f"{args.max_num_seqs}"]
        if "ulacache" in results and not results["ulacache"].get("failed"):
            lines.append(results["ulacache"]["arena_summary"])
        for n, r in results.items():
            if not r.get("failed"):
                lines.append(f"{n}: kv groups (spec, block tokens, page B, layers) "
                             f"{r['kv_groups']}, {r['num_blocks']} blocks")
        lines.append("shapes (prompt, output, requests, concurrency): " + json.dumps(shapes))
        lines += _table(model, results, [s for s in shapes])
        lines += _ladder_lines(model, results)
        if spec:
            lines.append(f"speculative decoding {json.dumps(spec)} (drafts judged, accepted):")
            for n, r in results.items():
                for sh, sr in ({} if r.get("failed") else r["shapes"]).items():
                    sd = sr.get("spec_decode") or {}
                    lines.append(f"  {n} {sh}: {sd.get('num_draft_tokens')} draft tokens, "
                                 f"{sd.get('num_accepted_tokens')} accepted "
                                 f"(rate {_fmt(sd.get('acceptance'), '.3f')}), step "
                                 f"{_fmt(sr.get('step_ms_median'))} ms median")
        window = json.loads((Path(path) / "config.json").read_text()).get("sliding_window")
        lines += ["", "targets:"] + ["  " + t for t in _targets(results, shapes, budget, window)]
        print("\n".join(lines), flush=True)
        lines_all += lines
        doc["models"][model]["report"] = lines
        # Write as we go: a later model's failure keeps this one's figures.
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    _plot(doc["models"], out.with_suffix(".png"))
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
