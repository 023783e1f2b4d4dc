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

``--hybrid``: hybrid models under the arena (`--kv-backend ulacache`) against stock vLLM, all
with prefix caching on and the same KV memory (``HYBRID``: sized so the workloads outgrow
it): tiny GPT-OSS (sliding window + full attention, float32), Gemma 3 (5 windows : 1 full,
float32) and Qwen3-Next (GDN state + full attention, bf16). Configurations: ulacache, stock
at its default block size (128 tokens on the CPU build; the GDN-aligned block for
Qwen3-Next) and stock at 32-token blocks (its best for GPT-OSS and Gemma 3; Qwen3-Next's block
is not the user's to choose). Each configuration runs in an engine of its own (offline
``LLM``, in-process core), ``--repeats`` times (prefix cache reset in between), two workloads:

- ``shared``: a few ~3k-token prefixes in two waves of single-turn prompts, 4 at a time: the
  first wave sends each prefix with two tails, the second with two new tails plus one
  prompt of the first wave again;
- ``chat``: multi-turn conversations, turn-major (every conversation's turn t before any
  turn t+1), 4 at a time, each turn the whole history plus a new user message.

Per wave / turn: hit tokens (vLLM's ``num_cached_tokens``), prompt tokens, prompt tokens
computed, TTFT (arrival to first token; mean and median), a digest of the generated tokens
(equal across configurations: token-exact; Qwen3-Next's bf16 GDN path is not batch-invariant
on the CPU build, so its digests may differ), and the arena's counters (compactions, cached
pages moved, cache evictions).

    python benchmarks/prefix_cache.py --hybrid                 # all three models, 2 repeats
    python benchmarks/prefix_cache.py --hybrid --models gpt_oss --repeats 3
    python benchmarks/prefix_cache.py --hybrid --models qwen3_next --hybrid-workloads shared
    python benchmarks/prefix_cache.py --hybrid --models qwen3_next --hybrid-workloads shared \
        --repeats 1 --kv-mib 12 --out /tmp/x   # another memory (file ..._12mib.json)

Writes ``prefix_cache_hybrid[_quick].json`` into ``--out``.
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


# ------------------------------------------------------------ hybrid models (the arena)
# name: (tiny-model overrides, dtype, KV bytes for every configuration (under pressure),
# max_num_batched_tokens). A prefill chunk holds a window page for each of its tokens until
# the next step (vLLM's sliding-window rule, stock and arena alike): Gemma 3's five window
# layers take 1024-token chunks, or one chunk's window pages would be most of the memory.
HYBRID = {
    "gpt_oss": ({"initializer_range": 0.1}, "float32", 28 << 20, 4096),
    "gemma3": ({"initializer_range": 0.1, "tie_word_embeddings": False}, "float32", 12 << 20,
               1024),
    "qwen3_next": ({}, "bfloat16", 10 << 20, 4096),
}
HYBRID_CONFIGS = (("ulacache", {"kv_backend": "ulacache"}),
                  ("stock", {"kv_backend": "vllm"}),
                  ("stock-bs32", {"kv_backend": "vllm", "block_size": 32}))
HYBRID_MARK = "@@PREFIX_HYBRID@@"
HYBRID_WORKLOADS = ("shared", "chat")
ARENA_FIGURES = ("compactions", "relayouts", "cached_pages_moved", "cache_evictions")


def hybrid_worker(cfg: dict) -> dict:
    """One engine (in this process): both workloads ``cfg["repeats"]`` times."""
    import random
    import statistics

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    w = cfg["workload"]
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True,
              max_model_len=w["max_model_len"], max_num_batched_tokens=cfg["batch_tokens"], enable_chunked_prefill=True,
              enable_prefix_caching=True, seed=0, max_num_seqs=4, disable_log_stats=False,
              kv_cache_memory_bytes=cfg["kv_bytes"], **cfg["kw"])
    cc = llm.llm_engine.vllm_config.cache_config
    ula = cfg["kw"].get("kv_backend") == "ulacache"

    def arena() -> dict:
        ms = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        return {f: ms.get(f"vllm:ulacache_arena_{f}", 0) for f in ARENA_FIGURES} if ula else {}

    def run(name: str, prompts: list[list[int]], out_len: int, rows: list) -> list[list[int]]:
        before = arena()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
                            use_tqdm=False)
        hit = sum(o.num_cached_tokens for o in outs)
        # Engine-core clock: queued (in the scheduler) to first token, and scheduled to
        # first token (the prefill itself, queueing behind other requests left out).
        ms = [o.metrics for o in outs if o.metrics is not None and o.metrics.first_token_ts]
        ttft = [1000 * (m.first_token_ts - m.queued_ts) for m in ms]
        prefill = [1000 * (m.first_token_ts - m.scheduled_ts) for m in ms]
        gen = [list(o.outputs[0].token_ids) for o in outs]
        after = arena()
        rows.append({"phase": name, "prompts": len(prompts),
                     "prompt_tokens": sum(map(len, prompts)), "hit_tokens": hit,
                     "computed_tokens": sum(map(len, prompts)) - hit,
                     "hits": [o.num_cached_tokens for o in outs],
                     "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
                     "ttft_ms_median": statistics.median(ttft) if ttft else None,
                     "prefill_ms_mean": statistics.fmean(prefill) if prefill else None,
                     "timed": len(ms),
                     "arena": {k: after[k] - before[k] for k in after},
                     "digest": hashlib.sha256(json.dumps(gen).encode()).hexdigest()[:12]})
        return gen

    repeats = []
    for _ in range(cfg["repeats"]):
        rows: list = []
        rng = random.Random(0)  # the same prompts in every repeat and configuration
        ids = lambda n: [rng.randrange(16, 1000) for _ in range(n)]  # noqa: E731
        assert llm.reset_prefix_cache()
        heads = [ids(n) for n in w["prefix_lens"]]
        first = [h + ids(t) for h in heads for t in w["tails"][0]]
        run("shared/wave1", first, w["out"], rows)
        run("shared/wave2", [h + ids(t) for h in heads for t in w["tails"][1]] + first[:1],
            w["out"], rows)
        if "chat" not in cfg.get("workloads", HYBRID_WORKLOADS):
            repeats.append(rows)
            continue
        assert llm.reset_prefix_cache()
        hist = [ids(w["chat_first"]) for _ in range(w["chats"])]
        for t in range(w["turns"]):
            prompts = [h + (ids(w["chat_user"]) if t else []) for h in hist]
            outs = run(f"chat/turn{t + 1}", prompts, w["chat_out"], rows)
            hist = [p + o for p, o in zip(prompts, outs)]
        repeats.append(rows)
    return {"block_size": cc.block_size, "num_gpu_blocks": cc.num_gpu_blocks,
            "repeats": repeats}


def hybrid_workload(quick: bool) -> dict:
    if quick:
        return {"prefix_lens": [1500, 1537, 1574], "tails": [[40, 49], [50, 57]], "out": 16,
                "chats": 8, "turns": 3, "chat_first": 512, "chat_user": 48, "chat_out": 16,
                "kv_scale": 0.5, "max_model_len": 2048}
    return {"prefix_lens": [3000, 3037, 3074], "tails": [[40, 49], [50, 57]], "out": 32,
            "chats": 10, "turns": 4, "chat_first": 768, "chat_user": 64, "chat_out": 32,
            "kv_scale": 1.0, "max_model_len": 4096}


def run_hybrid(a) -> None:
    from _host import cpu_host

    wl = hybrid_workload(a.quick)
    models = a.models.split(",")
    out = {"host": cpu_host(), "workload": wl, "repeats": a.repeats, "models": {}}
    for name in models:
        overrides, dtype, kv_bytes, batch_tokens = HYBRID[name]
        kv_bytes = int((a.kv_mib << 20 if a.kv_mib else kv_bytes) * wl["kv_scale"])
        model = _hybrid_model(name, overrides)
        rows = out["models"].setdefault(name, {"dtype": dtype, "kv_bytes": kv_bytes,
                                               "max_num_batched_tokens": batch_tokens,
                                               "configs": {}})
        for cname, kw in HYBRID_CONFIGS:
            if name == "qwen3_next" and "block_size" in kw:
                continue  # the GDN-aligned block is not the user's to choose
            cfg = {"model": model, "dtype": dtype, "kv_bytes": kv_bytes, "kw": kw,
                   "batch_tokens": batch_tokens, "workloads": a.hybrid_workloads,
                   "workload": wl, "repeats": a.repeats}
            print(f"[prefix_cache --hybrid] {name} / {cname}", flush=True)
            res = _hybrid_subprocess(cfg, a.timeout)
            rows["configs"][cname] = res
            _hybrid_report(name, cname, res, a.hybrid_workloads)
    stem = ("prefix_cache_hybrid" + (f"_{a.kv_mib}mib" if a.kv_mib else "")
            + ("_quick" if a.quick else ""))
    path = Path(a.out) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(a), **out}, indent=1, default=str))
    _hybrid_summary(out, a.hybrid_workloads)
    print(f"wrote {path}")


def _hybrid_model(name: str, overrides: dict) -> str:
    from ulacache_vllm.models import build_model

    path = Path(__file__).resolve().parents[1] / "models_cache" / f"bench-{name}-prefix"
    if not (path / "config.json").exists():
        build_model(name, path, overrides=overrides or None)
    return str(path)


def _hybrid_subprocess(cfg: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("TRITON_INTERPRET", None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the worker process
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t = time.perf_counter()
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--hybrid-worker",
                          json.dumps(cfg)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    for line in run.stdout.splitlines():
        if line.startswith(HYBRID_MARK):
            res = json.loads(line[len(HYBRID_MARK):])
            res["process_s"] = round(time.perf_counter() - t, 1)
            return res
    raise RuntimeError(f"hybrid worker failed (exit {run.returncode}):\n{run.stderr[-4000:]}")


def _phase_totals(rows: list[dict], prefix: str) -> dict:
    sel = [r for r in rows if r["phase"].startswith(prefix)]
    return {"hit_tokens": sum(r["hit_tokens"] for r in sel),
            "prompt_tokens": sum(r["prompt_tokens"] for r in sel),
            "computed_tokens": sum(r["computed_tokens"] for r in sel),
            "ttft_ms_mean": sum((r["ttft_ms_mean"] or 0) * r["prompts"] for r in sel)
            / max(1, sum(r["prompts"] for r in sel)),
            "digests": [r["digest"] for r in sel]}


def _hybrid_report(name: str, cname: str, res: dict, workloads=HYBRID_WORKLOADS) -> None:
    for i, rows in enumerate(res["repeats"]):
        for wl in workloads:
            t = _phase_totals(rows, wl)
            print(f"  {name:<10} {cname:<10} bs={res['block_size']:<4} rep {i} {wl:<6} "
                  f"hit {t['hit_tokens']:>6} / {t['prompt_tokens']:>6}  computed "
                  f"{t['computed_tokens']:>6}  TTFT mean {t['ttft_ms_mean']:8.1f} ms", flush=True)


def _hybrid_summary(out: dict, workloads=HYBRID_WORKLOADS) -> None:
    print("\nhit tokens, ulacache / stock (each repeat):")
    for name, m in out["models"].items():
        cfgs = m["configs"]
        for wl in workloads:
            ula = [_phase_totals(r, wl)["hit_tokens"] for r in cfgs["ulacache"]["repeats"]]
            for base in ("stock", "stock-bs32"):
                if base not in cfgs:
                    continue
                ref = [_phase_totals(r, wl)["hit_tokens"] for r in cfgs[base]["repeats"]]
                ratio = " ".join(f"{u / r:.2f}x" if r else f"{u}/0" for u, r in zip(ula, ref))
                print(f"  {name:<10} {wl:<6} vs {base:<10} {ratio}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--hybrid-worker":
        res = hybrid_worker(json.loads(sys.argv[2]))
        print(HYBRID_MARK + json.dumps(res), flush=True)
        return
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
    ap.add_argument("--hybrid", action="store_true",
                    help="hybrid models under the arena against stock (see the module doc)")
    ap.add_argument("--models", default=",".join(HYBRID), help="--hybrid: models to run")
    ap.add_argument("--repeats", type=int, default=2,
                    help="--hybrid: runs of both workloads per engine (cache reset between)")
    ap.add_argument("--hybrid-workloads", default=",".join(HYBRID_WORKLOADS),
                    type=lambda s: tuple(w for w in s.split(",") if w),
                    help="--hybrid: the workloads to run (shared, chat)")
    ap.add_argument("--kv-mib", type=int, default=0,
                    help="--hybrid: KV memory of every configuration in MiB instead of the "
                         "model's default (HYBRID); the file is prefix_cache_hybrid_<N>mib")
    a = ap.parse_args()
    if a.hybrid and (not a.hybrid_workloads or set(a.hybrid_workloads) - set(HYBRID_WORKLOADS)
                     or "shared" not in a.hybrid_workloads):
        ap.error(f"--hybrid-workloads: 'shared' or 'shared,chat' (got {a.hybrid_workloads})")
    if a.hybrid:
        run_hybrid(a)
        return
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
