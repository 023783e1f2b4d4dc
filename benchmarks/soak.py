"""Soak run through real servers: `vllm serve --kv-backend ulacache` under forced pressure,
many concurrent streaming completions for a while, a share cut by the client mid-stream, some
aborted during prefill, bursts beyond capacity; checked against a stock `vllm serve`.

1. A stock server (`--kv-backend vllm`, a roomy KV budget) gives every prompt's greedy text
   (streamed, a few at a time); it is stopped before the next one starts (one engine at a
   time).
2. A ulacache server with a small device budget and a small host pool (`--device-bytes`,
   `--host-bytes`) takes the load for ``--duration`` seconds: ``--concurrency`` streams in
   flight, raised to ``--burst`` for ``--burst-len`` seconds every ``--burst-every`` seconds
   (more than ``--max-num-seqs`` and more tokens than device + host hold: requests queue and
   get preempted). Each request is, at random (seeded): a full greedy stream; a stream cut by
   the client after a few chunks (``--cut-share``); or a request the client abandons before its
   first token, i.e. in the queue or in prefill (``--prefill-abort-share``).
3. Afterwards: the device and host pools (and the running / waiting queues) back to zero on
   `/metrics`; no request failed except those cut or abandoned on purpose; every uncut stream
   equals the stock server's greedy text for its prompt (and every cut stream is a prefix of
   it); the server still answers.

    python benchmarks/soak.py --quick            # ~5 minutes here; writes soak_quick.json
    python benchmarks/soak.py --duration 1800    # a longer manual run; writes soak.json
    python benchmarks/soak.py --quick --tp 2     # both servers at --tensor-parallel-size 2
    python benchmarks/soak.py --quick --hybrid gpt_oss   # a hybrid through the arena
    python benchmarks/soak.py --quick --hybrid gpt_oss --tp 2

Exits 1 when a check fails. Prints a summary table and writes ``soak[_tpP][_quick].json``
into ``--out`` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep, capacity, _host beside it
from sweep import RESULTS, Server, metric_sum  # noqa: E402

WORDS = ("the cache keeps every token key and value so model does not recompute them a request "
         "arrives scheduler admits it worker runs one forward pass when memory is full oldest "
         "pages move from device to host").split()
COUNTERS = ("vllm:ulacache_demotions_total", "vllm:ulacache_promotions_total",
            "vllm:ulacache_bytes_moved_total", "vllm:ulacache_lookups_total",
            "vllm:ulacache_hits_total", "vllm:ulacache_fast_path_exits_total",
            "vllm:num_preemptions_total", "vllm:ulacache_remote_rows_fetched_total",
            "vllm:ulacache_arena_compactions_total", "vllm:ulacache_arena_relayouts_total",
            "vllm:ulacache_arena_bytes_copied_total")
LEVELS = ("vllm:ulacache_device_used", "vllm:ulacache_host_used",
          "vllm:ulacache_arena_used_bytes", "vllm:ulacache_arena_withheld_bytes",
          "vllm:num_requests_running", "vllm:num_requests_waiting")


def make_prompts(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            for _ in range(n)]


def stream(base: str, model: str, prompt: str, max_tokens: int, cut_after: int | None = None,
           timeout: float = 600) -> dict:
    """One streaming greedy completion; with ``cut_after`` the client hangs up after that many
    chunks (vLLM aborts the request on disconnect)."""
    t0 = time.perf_counter()
    text, ttft = [], None
    with requests.post(base + "/v1/completions", stream=True, timeout=timeout, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk["choices"][0]["text"])
            if cut_after is not None and len(text) >= cut_after:
                break  # leaving the block closes the connection mid-stream
    return {"text": "".join(text), "chunks": len(text), "ttft_s": ttft,
            "e2e_s": time.perf_counter() - t0}


def abandon(base: str, model: str, prompt: str, max_tokens: int, wait_s: float) -> dict:
    """Send a request and hang up before its first token (a read timeout of ``wait_s``)."""
    try:
        r = requests.post(base + "/v1/completions", timeout=(5, wait_s), json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})
    except requests.exceptions.ReadTimeout:
        return {"abandoned": True}
    r.raise_for_status()
    return {"abandoned": False}  # answered within wait_s: counted, not a failure


def reference_texts(base: str, model: str, prompts: list[str], max_tokens: int,
                    workers: int) -> list[str]:
    with cf.ThreadPoolExecutor(workers) as ex:
        return [r["text"] for r in ex.map(lambda p: stream(base, model, p, max_tokens), prompts)]


def scrape(base: str) -> dict[str, float]:
    text = requests.get(base + "/metrics", timeout=10).text
    return {n: metric_sum(text, n) for n in COUNTERS + LEVELS}


class Load:
    """Keeps ``target()`` requests in flight until ``end``; records every request's outcome."""

    def __init__(self, base: str, model: str, prompts: list[str], a, rng: random.Random):
        self.base, self.model, self.prompts, self.a, self.rng = base, model, prompts, a, rng
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.peak_inflight = 0

    def target(self, t: float) -> int:
        a = self.a
        in_burst = a.burst_every > 0 and (t % a.burst_every) >= a.burst_every - a.burst_len
        return a.burst if in_burst else a.concurrency

    def one(self, i: int, kind: str, p: int, cut_after: int) -> None:
        rec = {"i": i, "kind": kind, "prompt": p, "t0": time.perf_counter()}
        try:
            if kind == "prefill_abort":
                rec.update(abandon(self.base, self.model, self.prompts[p], self.a.output_len,
                                   self.a.abandon_after))
            else:
                rec.update(stream(self.base, self.model, self.prompts[p], self.a.output_len,
                                  cut_after if kind == "cut" else None))
            rec["ok"] = True
        except Exception as e:  # noqa: BLE001 - every failure is a finding, recorded
            rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"[:500]
        rec["t1"] = time.perf_counter()
        with self.lock:
            self.records.append(rec)

    def run(self) -> float:
        a, rng = self.a, self.rng
        start = time.perf_counter()
        end = start + a.duration
        futures: set[cf.Future] = set()
        i = 0
        with cf.ThreadPoolExecutor(max(a.burst, a.concurrency)) as ex:
            while (now := time.perf_counter()) < end:
                futures = {f for f in futures if not f.done()}
                self.peak_inflight = max(self.peak_inflight, len(futures))
                while len(futures) < self.target(now - start):
                    u = rng.random()
                    kind = ("cut" if u < a.cut_share else "prefill_abort"
                            if u < a.cut_share + a.prefill_abort_share else "full")
                    futures.add(ex.submit(self.one, i, kind, rng.randrange(len(self.prompts)),
                                          rng.randint(1, max(1, a.output_len // 2))))
                    i += 1
                time.sleep(0.05)
            cf.wait(futures)
        return time.perf_counter() - start


def wait_drained(base: str, timeout: float) -> tuple[dict, float]:
    t0 = time.perf_counter()
    while True:
        m = scrape(base)
        if all(m[n] == 0 for n in LEVELS):
            return m, time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            return m, -1.0
        time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="DSA model (default: the embedded tiny one)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hybrid", choices=("gpt_oss",), default=None,
                    help="soak a tiny hybrid model through the arena instead (float32; "
                         "--device-bytes is then the arena's KV budget, compactions and "
                         "relayouts forced every 4 steps)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both servers")
    ap.add_argument("--device-bytes", type=int, default=11_000_000,
                    help="ulacache device KV budget (small: forced pressure)")
    ap.add_argument("--host-bytes", type=int, default=6_442_450,
                    help="ulacache host pool (0.006 GiB: small)")
    ap.add_argument("--stock-bytes", type=int, default=256 << 20, help="stock KV budget")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16,
                    help="ulacache server; with --burst above it requests queue, and 16 of "
                    "the longer prompts outgrow device + host: preemption")
    ap.add_argument("--duration", type=float, default=1800, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=6, help="streams in flight")
    ap.add_argument("--burst", type=int, default=20, help="streams in flight during a burst")
    ap.add_argument("--burst-every", type=float, default=60)
    ap.add_argument("--burst-len", type=float, default=15)
    ap.add_argument("--cut-share", type=float, default=0.25)
    ap.add_argument("--prefill-abort-share", type=float, default=0.1)
    ap.add_argument("--abandon-after", type=float, default=0.05,
                    help="a prefill abort hangs up after this many seconds without an answer")
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    ap.add_argument("--min-words", type=int, default=40)
    ap.add_argument("--max-words", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="150 s of load, 16 prompts, 32 tokens out, bursts every 40 s")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.quick:
        a.duration, a.prompts, a.output_len, a.burst_every, a.burst_len = 150, 16, 32, 40, 12
    if a.hybrid:
        from hybrid_capacity import _model_path

        a.model = a.model or _model_path(a.hybrid)
        if a.device_bytes == ap.get_default("device_bytes"):
            # Per rank: at TP=P each rank's pages hold 1/P of the heads, so the same pressure
            # takes 1/P of the bytes.
            a.device_bytes = (6 << 20) // a.tp
    if a.model is None:
        from capacity import _build_default_model

        a.model = _build_default_model()
    from _host import cpu_host

    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    common = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--seed", "0"]
    if a.tp > 1:
        common += ["--tensor-parallel-size", str(a.tp)]
        if (os.cpu_count() or 1) <= a.tp:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(a.tp)))
    stock_args = [a.model, "--kv-backend", "vllm", "--kv-cache-memory-bytes",
                  str(a.stock_bytes), "--max-num-seqs", "8", *common]
    tiers = (["--ula-arena-force-moves", "4"] if a.hybrid else
             ["--ula-host-pool-gib", f"{a.host_bytes / (1 << 30):.6f}"])
    ula_args = [a.model, "--kv-backend", "ulacache", "--kv-cache-memory-bytes",
                str(a.device_bytes), *tiers, "--max-num-seqs", str(a.max_num_seqs), *common]
    prompts = make_prompts(a.prompts, a.min_words, a.max_words, a.seed)
    logs = Path(tempfile.mkdtemp(prefix="soak_"))
    timing = {}

    t0 = time.perf_counter()
    print(f"[soak] stock server: greedy reference for {len(prompts)} prompts", flush=True)
    with Server(stock_args, logs / "stock.log", env, timeout=900) as srv:
        timing["stock_boot_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        ref = reference_texts(srv.base, a.model, prompts, a.output_len, workers=4)
        timing["reference_s"] = time.perf_counter() - t1

    t0 = time.perf_counter()
    print(f"[soak] ulacache server: {a.duration:.0f} s of load", flush=True)
    with Server(ula_args, logs / "ulacache.log", env, timeout=900) as srv:
        timing["ulacache_boot_s"] = time.perf_counter() - t0
        before = scrape(srv.base)
        load = Load(srv.base, a.model, prompts, a, random.Random(a.seed))
        timing["load_s"] = load.run()
        after, drain_s = wait_drained(srv.base, timeout=120)
        timing["drain_s"] = drain_s
        final = requests.post(srv.base + "/v1/completions", timeout=120, json={
            "model": a.model, "prompt": "still serving?", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        still_serving = final.ok and final.json()["usage"]["completion_tokens"] == 4
    recs = sorted(load.records, key=lambda r: r["i"])

    full = [r for r in recs if r["kind"] == "full"]
    cut = [r for r in recs if r["kind"] == "cut"]
    pre = [r for r in recs if r["kind"] == "prefill_abort"]
    failed = [r for r in recs if not r["ok"]]
    mismatches = [r for r in full if r["ok"] and r["text"] != ref[r["prompt"]]]
    cut_not_prefix = [r for r in cut if r["ok"] and not ref[r["prompt"]].startswith(r["text"])]
    delta = {n: after[n] - before[n] for n in COUNTERS}
    e2e = sorted(r["e2e_s"] for r in full if r["ok"])
    ttft = sorted(r["ttft_s"] for r in full if r["ok"] and r["ttft_s"] is not None)
    pct = (lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None)
    checks = {
        "pools_and_queues_zero": all(after[n] == 0 for n in LEVELS),
        "no_failures": not failed,
        "uncut_equal_stock": not mismatches and len(full) > 0,
        "cut_prefix_of_stock": not cut_not_prefix,
        # DSA: rows went to the host tier; the arena: pages moved (forced) and running
        # requests were preempted.
        "under_pressure": (delta["vllm:ulacache_arena_bytes_copied_total"] > 0
                           and delta["vllm:num_preemptions_total"] > 0) if a.hybrid else
        delta["vllm:ulacache_demotions_total"] > 0,
        "still_serving": still_serving,
    }
    summary = {
        "requests": len(recs), "full": len(full), "cut": len(cut),
        "prefill_aborted": sum(1 for r in pre if r.get("abandoned")),
        "prefill_answered_in_time": sum(1 for r in pre if r["ok"] and not r.get("abandoned")),
        "failed": len(failed), "mismatches": len(mismatches),
        "cut_not_prefix": len(cut_not_prefix), "peak_inflight": load.peak_inflight,
        "demotions": delta["vllm:ulacache_demotions_total"],
        "promotions": delta["vllm:ulacache_promotions_total"],
        "preemptions": delta["vllm:num_preemptions_total"],
        "bytes_moved": delta["vllm:ulacache_bytes_moved_total"],
        "arena_compactions": delta["vllm:ulacache_arena_compactions_total"],
        "arena_relayouts": delta["vllm:ulacache_arena_relayouts_total"],
        "arena_bytes_copied": delta["vllm:ulacache_arena_bytes_copied_total"],
        "full_e2e_p50_s": pct(e2e, 0.5), "full_e2e_p99_s": pct(e2e, 0.99),
        "full_ttft_p50_s": pct(ttft, 0.5), "full_ttft_p99_s": pct(ttft, 0.99),
        "output_tokens_full": len(full) * a.output_len,
    }
    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}"
          f", TP={a.tp}")
    rows = [("requests (full / cut / prefill-abort)",
             f"{len(recs)} ({len(full)} / {len(cut)} / {len(pre)})"),
            ("abandoned before the first token", summary["prefill_aborted"]),
            ("failed (not cut on purpose)", summary["failed"]),
            ("uncut streams != stock greedy text", summary["mismatches"]),
            ("cut streams not a prefix of it", summary["cut_not_prefix"]),
            ("peak requests in flight", summary["peak_inflight"]),
            ("demotions / promotions", f"{summary['demotions']:.0f} / "
                                       f"{summary['promotions']:.0f}"),
            ("preemptions", f"{summary['preemptions']:.0f}"),
            ("arena compactions / relayouts / bytes copied",
             f"{summary['arena_compactions']:.0f} / {summary['arena_relayouts']:.0f} / "
             f"{summary['arena_bytes_copied']:.0f}"),
            ("full stream e2e p50 / p99 (s)", f"{summary['full_e2e_p50_s'] or 0:.2f} / "
                                              f"{summary['full_e2e_p99_s'] or 0:.2f}"),
            ("pools + queues after (dev, host, arena used, arena withheld, run, wait)",
             " ".join(f"{after[n]:.0f}" for n in LEVELS)),
            ("drained in (s)", f"{drain_s:.1f}"),
            ("boot stock / ulacache, reference, load (s)",
             f"{timing['stock_boot_s']:.0f} / {timing['ulacache_boot_s']:.0f}, "
             f"{timing['reference_s']:.0f}, {timing['load_s']:.0f}")]
    for k, v in rows:
        print(f"  {k:<46} {v}")
    for k, v in checks.items():
        print(f"  check {k:<40} {'ok' if v else 'FAILED'}")
    for r in failed[:5]:
        print(f"  failed request {r['i']} ({r['kind']}): {r['error']}")
    for r in mismatches[:5]:
        print(f"  mismatch request {r['i']} prompt {r['prompt']}: {r['text'][:80]!r} vs "
              f"{ref[r['prompt']][:80]!r}")
    name = ("soak" + (f"_{a.hybrid}" if a.hybrid else "") + (f"_tp{a.tp}" if a.tp > 1 else "")
            + ("_quick" if a.quick else ""))
    out = Path(a.out) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(a), "host": host, "servers": {"stock": stock_args, "ulacache": ula_args},
        "checks": checks, "summary": summary, "timing": timing, "metrics_after": after,
        "counters_delta": delta, "logs": str(logs),
        "failed": failed[:20], "mismatches": mismatches[:20]}, indent=2, default=str))
    print(f"wrote {out} (server logs in {logs})")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
