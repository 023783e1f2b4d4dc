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

Writes ``prefix_cache[_quick].json`` (per configuration: bench results, metrics, server
command line; the host) and ``.png`` into ``--out`` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sweep, capacity, _host beside it
from sweep import RESULTS, Server, metric_sum  # noqa: E402

METRICS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
           "vllm:ulacache_prefix_hit_entries_total",
           "vllm:ulacache_prefix_hit_entries_host_total",
           "vllm:ulacache_promotions_total", "vllm:ulacache_demotions_total")
BENCH_KEYS = ("completed", "duration", "request_throughput", "output_throughput",
              "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def scrape(base: str) -> dict[str, float]:
    text = requests.get(base + "/metrics", timeout=10).text
    return {m: metric_sum(text, m) for m in METRICS}


def configurations(a) -> list[tuple[str, list[str]]]:
    D, H = a.device_bytes, a.host_bytes
    # The reference MLA path's schedule on every host (block 16, whole-prompt steps), with
    # prefix caching asked for explicitly (the CPU sparse-MLA backend takes it everywhere).
    common = [a.model, "--dtype", "float32", "--max-model-len", str(a.max_model_len),
              "--max-num-seqs", str(a.concurrency), "--seed", "0", "--block-size", "16",
              "--no-enable-chunked-prefill", "--enable-prefix-caching",
              "--max-num-batched-tokens", str(max(a.max_model_len, 2048))]
    return [
        ("stock-D", common + ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D)]),
        ("stock-D+H", common + ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D + H)]),
        ("ulacache-D+host-H", common + ["--kv-backend", "ulacache", "--kv-cache-memory-bytes", str(D),
                                   "--ula-host-pool-gib", f"{H / (1 << 30):.6f}"]),
    ]


def bench(base: str, a, out_dir: Path, env: dict) -> dict:
    fname = f"prefix_{time.monotonic_ns()}.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", base, "--model", a.model, "--tokenizer", a.model,
           "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(a.prefix_len),
           "--prefix-repetition-suffix-len", str(a.suffix_len),
           "--prefix-repetition-num-prefixes", str(a.num_prefixes),
           "--prefix-repetition-output-len", str(a.output_len),
           "--num-prompts", str(a.prompts), "--max-concurrency", str(a.concurrency),
           "--ignore-eos", "--percentile-metrics", "ttft,tpot", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
           "--seed", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    path = out_dir / fname
    if run.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    res = json.loads(path.read_text())
    return {k: res.get(k) for k in BENCH_KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="DSA model (default: the embedded tiny one)")
    ap.add_argument("--device-bytes", type=int, default=12_000_000, help="D: device KV budget")
    ap.add_argument("--host-bytes", type=int, default=24_000_000, help="H: host pool")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true", help="6 prefixes x 6 prompts, 8 out")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.quick:
        a.num_prefixes, a.prompts, a.output_len = 6, 36, 8
    if a.model is None:
        from capacity import _build_default_model

        a.model = _build_default_model()
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    tmp = Path(tempfile.mkdtemp(prefix="prefix_cache_"))
    rows = []
    for name, args in configurations(a):
        print(f"[prefix_cache] {name}: starting", flush=True)
        with Server(args, tmp / f"{name}.log", env, timeout=600) as srv:
            before = scrape(srv.base)
            res = bench(srv.base, a, tmp, env)
            after = scrape(srv.base)
        m = {k: after[k] - before[k] for k in METRICS}
        q, h = m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]
        rows.append({"config": name, **res, "metrics": m, "hit_rate": h / q if q else 0.0,
                     "prefill_tokens_computed": m["vllm:prompt_tokens_total"] - h,
                     "server": " ".join(args)})
    from _host import cpu_host

    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    print(f"{'config':<14} {'hit rate':>8} {'hit tok':>8} {'computed':>9} {'host hits':>9} "
          f"{'TTFT p50':>9} {'TTFT mean':>9} {'preempt':>7}")
    for r in rows:
        m = r["metrics"]
        print(f"{r['config']:<14} {r['hit_rate']:>8.3f} {m['vllm:prefix_cache_hits_total']:>8.0f} "
              f"{r['prefill_tokens_computed']:>9.0f} "
              f"{m['vllm:ulacache_prefix_hit_entries_host_total']:>9.0f} "
              f"{r['median_ttft_ms'] or 0:>9.1f} {r['mean_ttft_ms'] or 0:>9.1f} "
              f"{m['vllm:num_preemptions_total']:>7.0f}")
    base = next(r for r in rows if r["config"] == "stock-D")
    ula = next(r for r in rows if r["config"].startswith("ulacache"))
    if base["metrics"]["vllm:prefix_cache_hits_total"]:
        print(f"ulacache / stock-D prefix-cache hit tokens: "
              f"{ula['metrics']['vllm:prefix_cache_hits_total'] / base['metrics']['vllm:prefix_cache_hits_total']:.2f}x "
              f"(same device budget, same run)")
    out = Path(a.out) / ("prefix_cache" + ("_quick" if a.quick else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"args": vars(a), "host": host, "configs": rows}, indent=2, default=str))
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    ax[0].bar(names, [r["hit_rate"] for r in rows])
    ax[0].set_title("prefix-cache hit rate (tokens)")
    ax[1].bar(names, [r["prefill_tokens_computed"] for r in rows])
    ax[1].set_title("prompt tokens computed")
    ax[2].bar(names, [r["median_ttft_ms"] or 0 for r in rows])
    ax[2].set_title("TTFT p50 (ms)")
    for a_ in ax:
        a_.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
