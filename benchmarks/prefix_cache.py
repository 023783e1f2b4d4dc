"""Prefix caching through real servers: the host pool as a second prefix-cache tier.

`vllm serve` per configuration, all with prefix caching on: stock vLLM with device KV budget D,
stock with D + H on the device (the bound), ulacache with D on the device and H in the host
pool. Each runs `vllm bench serve` on vLLM's `prefix_repetition` dataset (a few long shared
prefixes, many suffixes) whose prefixes outgrow D, then `/metrics` gives the prefix-cache
queries and hits (tokens), the prompt tokens computed (queried - hit), preemptions, and for
ulacache the hit entries read from the host tier. Stock at D evicts prefixes the moment they
leave the device; ulacache keeps them in the host pool (exclusive residency: never twice).
Hits are what the budgets keep, not throughput: read TTFT beside them.

    python benchmarks/prefix_cache.py --quick
    python benchmarks/prefix_cache.py --num-prefixes 8 --prefix-len 384 --prompts 96

Two more workloads (``--workload``), same three configurations:

- ``multiturn``: conversations driven through the OpenAI completions API of each server, every
  turn resending the whole history (token ids) plus a new user message; turns go round the
  conversations (``--mt-parallel`` at a time), so between two turns of one conversation the
  others' histories pass through the cache: their sum outgrows D. Hit rate, prompt tokens
  computed, TTFT of turns >= 2 (streamed, client side).
- ``preempt``: ``vllm bench serve`` random prompts with long outputs at a concurrency whose KV
  outgrows every pool, so vLLM preempts (recompute). A resumed request is looked up in the
  prefix cache again and hits its own surviving blocks; vLLM records those lookups
  (``PrefixCacheStats.preempted_*``) but exports them nowhere, so each server here is started
  through this script (``--serve``), which exports them as ``vllm:prefix_cache_preempted_
  {requests,queries,hits}_total`` (observation only, same for every configuration).
  Recomputed prefill tokens per preemption = (preempted queries - hits) / resumes.

    python benchmarks/prefix_cache.py --quick --workload all

Writes ``prefix_cache[_<workload>][_quick].json`` (per configuration: results, metrics,
server command line; the host) and ``.png`` into ``--out`` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep, capacity, _host beside it
from sweep import RESULTS, Server, metric_sum  # noqa: E402

METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
           "vllm:ulacache_prefix_hit_entries_total",
           "vllm:ulacache_prefix_hit_entries_host_total",
           "vllm:ulacache_promotions_total", "vllm:ulacache_demotions_total",
           "vllm:generation_tokens_total", "vllm:prefix_cache_preempted_requests_total",
           "vllm:prefix_cache_preempted_queries_total", "vllm:prefix_cache_preempted_hits_total")
PREEMPTED = ("requests", "queries", "hits")
BENCH_KEYS = ("completed", "duration", "request_throughput", "output_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def scrape(base: str) -> dict[str, float]:
    text = requests.get(base + "/metrics", timeout=10).text
    out = {m: metric_sum(text, m) for m in METRICS}
    blocks = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
    out["num_gpu_blocks"] = float(blocks.group(1)) if blocks else 0.0
    return out


def export_preempted_stats() -> None:
    """vLLM's Prometheus logger also exports `PrefixCacheStats.preempted_*` (the prefix-cache
    lookups of resumed requests, which vLLM records and exports nowhere) as
    ``vllm:prefix_cache_preempted_{requests,queries,hits}``: observation only."""
    from vllm.v1.metrics import loggers

    cls = loggers.PrometheusStatLogger
    if getattr(cls, "_preempted_exported", False):
        return
    init, record = cls.__init__, cls.record

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)  # (unregisters every earlier vllm:* collector first)
        self._preempted = {f: self._counter_cls(
            name=f"vllm:prefix_cache_preempted_{f}",
            documentation=f"Prefix-cache lookups of resumed (preempted) requests: {f}",
            labelnames=[]) for f in PREEMPTED}

    def record_(self, scheduler_stats, *args, **kwargs):
        pcs = getattr(scheduler_stats, "prefix_cache_stats", None)
        if pcs is not None:
            for f, c in self._preempted.items():
                c.inc(getattr(pcs, f"preempted_{f}"))
        return record(self, scheduler_stats, *args, **kwargs)

    cls.__init__, cls.record, cls._preempted_exported = __init__, record_, True


class StatsServer(Server):
    """`vllm serve` started through this script (`--serve`): the preempted lookups exported."""

    def __init__(self, args, log, env, timeout):
        super().__init__(args, log, env, timeout)
        self.cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", *self.cmd[1:]]


def configurations(a, max_num_seqs: int | None = None) -> list[tuple[str, list[str]]]:
    D, H = a.device_bytes, a.host_bytes
    # The reference MLA path's schedule on every host (block 16, whole-prompt steps), with
    # prefix caching asked for explicitly (the CPU sparse-MLA backend takes it everywhere).
    common = [a.model, "--dtype", "float32", "--max-model-len", str(a.max_model_len),
              "--max-num-seqs", str(max_num_seqs or a.concurrency), "--seed", "0",
              "--block-size", "16",
              "--no-enable-chunked-prefill", "--enable-prefix-caching",
              "--max-num-batched-tokens", str(max(a.max_model_len, 2048))]
    return [
        ("stock-D", common + ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D)]),
        ("stock-D+H", common + ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D + H)]),
        ("ulacache-D+host-H", common + ["--kv-backend", "ulacache", "--kv-cache-memory-bytes", str(D),
                                   "--ula-host-pool-gib", f"{H / (1 << 30):.6f}"]),
    ]


def bench(base: str, a, out_dir: Path, env: dict, dataset: list[str],
          concurrency: int, prompts: int) -> dict:
    fname = f"prefix_{time.monotonic_ns()}.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", base, "--model", a.model, "--tokenizer", a.model, *dataset,
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--percentile-metrics", "ttft,tpot", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
           "--seed", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    path = out_dir / fname
    if run.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    res = json.loads(path.read_text())
    return {k: res.get(k) for k in BENCH_KEYS}


def prefix_workload(base: str, a, tmp: Path, env: dict) -> dict:
    return bench(base, a, tmp, env, [
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(a.prefix_len),
        "--prefix-repetition-suffix-len", str(a.suffix_len),
        "--prefix-repetition-num-prefixes", str(a.num_prefixes),
        "--prefix-repetition-output-len", str(a.output_len)], a.concurrency, a.prompts)


def preempt_workload(base: str, a, tmp: Path, env: dict) -> dict:
    return bench(base, a, tmp, env, [
        "--dataset-name", "random", "--random-input-len", str(a.pre_input_len),
        "--random-output-len", str(a.pre_output_len), "--random-range-ratio", "0"],
        a.pre_concurrency, a.pre_prompts)


def _tokens(rng, n: int) -> list[int]:
    return [rng.randrange(16, 1000) for _ in range(n)]  # plain ids of the tiny vocab (1024)


def multiturn_workload(base: str, a, tmp: Path, env: dict) -> dict:
    """Conversations over the completions API, each turn the whole history (token ids) plus a
    new user message; turn-major (every conversation's turn t before any turn t+1), at most
    ``mt_parallel`` requests at once. TTFT from the first streamed chunk."""
    import random

    rng = random.Random(0)
    hist = [_tokens(rng, a.mt_first_len) for _ in range(a.mt_conversations)]
    users = [[_tokens(rng, a.mt_user_len) for _ in range(a.mt_turns)]
             for _ in range(a.mt_conversations)]
    ttft: list[list[float]] = [[] for _ in range(a.mt_turns)]
    lock = threading.Lock()

    def turn(c: int, t: int) -> None:
        prompt = hist[c] + (users[c][t] if t else [])
        body = {"model": a.model, "prompt": prompt, "max_tokens": a.mt_output_len,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
        t0, first, out = time.perf_counter(), None, []
        with requests.post(base + "/v1/completions", json=body, stream=True,
                           timeout=a.timeout) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t0
                out += ids
        assert len(out) == a.mt_output_len, (c, t, len(out))
        with lock:
            hist[c] = prompt + out
            ttft[t].append(1000 * (first or 0.0))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.mt_parallel) as pool:
        for t in range(a.mt_turns):
            list(pool.map(lambda c: turn(c, t), range(a.mt_conversations)))
    later = sorted(x for ts in ttft[1:] for x in ts)
    return {"duration": time.perf_counter() - t0, "completed": sum(map(len, ttft)),
            "median_ttft_ms": later[len(later) // 2] if later else None,
            "mean_ttft_ms": sum(later) / len(later) if later else None,
            "ttft_ms_by_turn": [sum(ts) / len(ts) for ts in ttft],
            "final_history_tokens": [len(h) for h in hist],
            # equal across configurations when every one generated the same tokens (greedy)
            "history_digest": hashlib.sha256(json.dumps(hist).encode()).hexdigest()[:16]}


WORKLOADS = {"prefix": prefix_workload, "multiturn": multiturn_workload,
             "preempt": preempt_workload}


def run_workload(wl: str, a, env: dict, tmp: Path) -> list[dict]:
    seqs = a.pre_concurrency if wl == "preempt" else (
        a.mt_parallel if wl == "multiturn" else a.concurrency)
    rows = []
    for name, args in configurations(a, seqs):
        print(f"[prefix_cache] {wl} / {name}: starting", flush=True)
        with StatsServer(args, tmp / f"{wl}-{name}.log", env, timeout=600) as srv:
            before = scrape(srv.base)
            res = WORKLOADS[wl](srv.base, a, tmp, env)
            after = scrape(srv.base)
        m = {k: after[k] - before[k] for k in METRICS}
        q, h = m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]
        pq, ph = (m[f"vllm:prefix_cache_preempted_{f}_total"] for f in ("queries", "hits"))
        resumes = m["vllm:prefix_cache_preempted_requests_total"]
        rows.append({"config": name, **res, "metrics": m, "hit_rate": h / q if q else 0.0,
                     "num_gpu_blocks": after["num_gpu_blocks"],
                     "prefill_tokens_computed": m["vllm:prompt_tokens_total"] - h,
                     # a resumed request recomputes what its lookup did not hit
                     "recomputed_on_resume": pq - ph,
                     "recomputed_per_preemption": (pq - ph) / resumes if resumes else None,
                     "resume_hit_rate": ph / pq if pq else None,
                     "server": " ".join(args)})
    return rows


def report(wl: str, rows: list[dict]) -> None:
    print(f"\n[{wl}] {'config':<18} {'blocks':>6} {'hit rate':>8} {'hit tok':>8} {'computed':>9} "
          f"{'host hits':>9} {'TTFT p50':>9} {'preempt':>7} {'resumes':>7} {'res.hit':>7} "
          f"{'recomp/pre':>10}")
    for r in rows:
        m = r["metrics"]
        rpp = r["recomputed_per_preemption"]
        print(f"[{wl}] {r['config']:<18} {r['num_gpu_blocks']:>6.0f} {r['hit_rate']:>8.3f} "
              f"{m['vllm:prefix_cache_hits_total']:>8.0f} {r['prefill_tokens_computed']:>9.0f} "
              f"{m['vllm:ulacache_prefix_hit_entries_host_total']:>9.0f} "
              f"{r['median_ttft_ms'] or 0:>9.1f} {m['vllm:num_preemptions_total']:>7.0f} "
              f"{m['vllm:prefix_cache_preempted_requests_total']:>7.0f} "
              f"{r['resume_hit_rate'] or 0:>7.3f} {'-' if rpp is None else f'{rpp:.1f}':>10}")
    base = next(r for r in rows if r["config"] == "stock-D")
    ula = next(r for r in rows if r["config"].startswith("ulacache"))
    if base["metrics"]["vllm:prefix_cache_hits_total"]:
        print(f"[{wl}] ulacache / stock-D prefix-cache hit tokens: "
              f"{ula['metrics']['vllm:prefix_cache_hits_total'] / base['metrics']['vllm:prefix_cache_hits_total']:.2f}x "
              f"(same device budget, same run)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":  # StatsServer: `vllm serve ARGS`
        export_preempted_stats()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *sys.argv[2:]]
        vllm_main()
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="DSA model (default: the embedded tiny one)")
    ap.add_argument("--workload", default="prefix", choices=(*WORKLOADS, "all"))
    ap.add_argument("--device-bytes", type=int, default=12_000_000, help="D: device KV budget")
    ap.add_argument("--host-bytes", type=int, default=24_000_000, help="H: host pool")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--mt-conversations", type=int, default=12)
    ap.add_argument("--mt-turns", type=int, default=5)
    ap.add_argument("--mt-first-len", type=int, default=256, help="first turn's tokens")
    ap.add_argument("--mt-user-len", type=int, default=64, help="each later user message")
    ap.add_argument("--mt-output-len", type=int, default=32)
    ap.add_argument("--mt-parallel", type=int, default=4, help="requests at once")
    ap.add_argument("--pre-input-len", type=int, default=384)
    ap.add_argument("--pre-output-len", type=int, default=256)
    ap.add_argument("--pre-prompts", type=int, default=32)
    ap.add_argument("--pre-concurrency", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true",
                    help="prefix: 6 prefixes x 6 prompts, 8 out; multiturn: 8 conversations "
                         "x 4 turns; preempt: 24 prompts, 192 out")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.quick:
        a.num_prefixes, a.prompts, a.output_len = 6, 36, 8
        a.mt_conversations, a.mt_turns = 8, 4
        a.pre_prompts, a.pre_output_len = 24, 192
    if a.model is None:
        from capacity import _build_default_model

        a.model = _build_default_model()
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tmp = Path(tempfile.mkdtemp(prefix="prefix_cache_"))
    from _host import cpu_host

    host = cpu_host()
    print(f"host: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    for wl in (WORKLOADS if a.workload == "all" else (a.workload,)):
        rows = run_workload(wl, a, env, tmp)
        report(wl, rows)
        stem = "prefix_cache" + ("" if wl == "prefix" else f"_{wl}") + ("_quick" if a.quick else "")
        out = Path(a.out) / stem
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(
            {"args": vars(a), "workload": wl, "host": host, "configs": rows}, indent=2,
            default=str))
        plot(wl, rows, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(wl: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    panels = [("prefix-cache hit rate (tokens)", [r["hit_rate"] for r in rows]),
              ("prompt tokens computed", [r["prefill_tokens_computed"] for r in rows]),
              ("TTFT p50 (ms)" + (", turns >= 2" if wl == "multiturn" else ""),
               [r["median_ttft_ms"] or 0 for r in rows])]
    if wl == "preempt":
        panels = [("preemptions", [r["metrics"]["vllm:num_preemptions_total"] for r in rows]),
                  ("recomputed prefill tokens per preemption",
                   [r["recomputed_per_preemption"] or 0 for r in rows]),
                  ("recomputed prefill tokens, all resumes",
                   [r["recomputed_on_resume"] for r in rows]),
                  ("resumed lookups' hit rate", [r["resume_hit_rate"] or 0 for r in rows]),
                  ("TTFT p50 (ms)", [r["median_ttft_ms"] or 0 for r in rows])]
    fig, ax = plt.subplots(1, len(panels), figsize=(4.7 * len(panels), 4))
    for a_, (title, vals) in zip(ax, panels):
        a_.bar(names, vals)
        a_.set_title(title, fontsize=10)
        a_.tick_params(axis="x", rotation=20)
    fig.suptitle(f"prefix_cache.py: {wl}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
