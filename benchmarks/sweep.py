"""Throughput sweep through real servers: `vllm serve` per configuration, `vllm bench serve` per
concurrency point, `/metrics` scraped during each point.

Configurations (side by side in one run): stock vLLM with device KV budget D; stock with D + H
on the device (the bound); ulacache with D on the device and H in the host pool; with
``--tp P`` each at tensor-parallel size P, ulacache in both TP modes (replicate, shard).
``--v4``: the same three on the tiny DeepSeek-V4 (the host pool holds its CSA rows);
``--hybrid``: stock, stock with 32-token blocks and the arena at one budget D.
Each point runs `vllm bench serve` (random dataset, fixed input/output lengths,
``--ignore-eos``, ``--max-concurrency c``, ``--percentile-metrics ttft,tpot,itl,e2el``,
``--save-result``) while a thread scrapes the server's `/metrics` (running requests,
preemptions, KV usage, the ulacache counters). Read the curves at equal concurrency as well as
at their peaks: a peak reached at a batch the baseline cannot hold is not a speedup at equal
batch.

    python benchmarks/sweep.py --quick
    python benchmarks/sweep.py --model /path/to/dsa --device-bytes ... --host-bytes ... \
        --concurrency 1 4 16 64 --input-len 1024 --output-len 256

Writes ``sweep[_quick].json`` (every point, the server command lines, the host) and
``sweep[_quick].png`` into ``--out`` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _host, beside this script

SCRAPED = {  # /metrics series -> how a point summarises them
    "vllm:num_requests_running": "max",
    "vllm:num_preemptions_total": "delta",
    "vllm:kv_cache_usage_perc": "max",
    "vllm:ulacache_promotions_total": "delta",
    "vllm:ulacache_demotions_total": "delta",
    "vllm:ulacache_remote_rows_fetched_total": "delta",
    "vllm:ulacache_device_used": "max",
    "vllm:ulacache_host_used": "max",
}
BENCH_KEYS = ("completed", "duration", "output_throughput", "total_token_throughput",
              "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
              "median_e2el_ms", "p99_e2el_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_sum(text: str, name: str) -> float:
    """Sum of a series over its label sets (engines, ranks)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


class Scraper(threading.Thread):
    """Polls /metrics until stopped; keeps the first, last and max of each scraped series."""

    def __init__(self, base: str, every: float = 0.25):
        super().__init__(daemon=True)
        self.base, self.every = base, every
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.max: dict[str, float] = {}
        self._halt = threading.Event()

    def scrape(self) -> None:
        try:
            text = requests.get(self.base + "/metrics", timeout=5).text
        except requests.RequestException:
            return
        for name in SCRAPED:
            v = metric_sum(text, name)
            self.first.setdefault(name, v)
            self.last[name] = v
            self.max[name] = max(self.max.get(name, v), v)

    def run(self) -> None:
        while not self._halt.is_set():
            self.scrape()
            self._halt.wait(self.every)

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join()
        self.scrape()
        return {name: (self.max.get(name, 0.0) if how == "max" else
                       self.last.get(name, 0.0) - self.first.get(name, 0.0))
                for name, how in SCRAPED.items()}


class Server:
    """`vllm serve` on a free 127.0.0.1 port in its own process group."""

    def __init__(self, args: list[str], log: Path, env: dict, timeout: float):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(Path(sys.executable).parent / "vllm"), "serve", *args,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log
        self.env = env
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.fh = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.fh, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, cwd=ROOT)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()[-4000:]}")
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy in {self.timeout}s:\n{self.log.read_text()[-4000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.fh.close()


def bench_point(base: str, model: str, c: int, a, out_dir: Path, env: dict) -> dict:
    """One `vllm bench serve` run at max concurrency ``c``; returns its saved result."""
    fname = f"point_{c}_{time.monotonic_ns()}.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "vllm",
           "--base-url", base, "--model", model, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(max(a.prompts_per_level * c, c)), "--max-concurrency", str(c),
           "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", fname, "--disable-tqdm",
           "--seed", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.point_timeout)
    path = out_dir / fname
    if run.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve failed (c={c}):\n{run.stdout[-3000:]}\n"
                           f"{run.stderr[-3000:]}")
    res = json.loads(path.read_text())
    return {k: res.get(k) for k in BENCH_KEYS}


def configurations(a) -> list[tuple[str, list[str]]]:
    if a.hybrid:
        # Hybrid models: one KV budget D for stock HMA (its default block), stock with
        # 32-token blocks (vLLM re-aligns a GDN hybrid's block anyway), and the ulacache arena.
        common = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
                  "--max-num-seqs", str(max(a.concurrency)), "--seed", "0",
                  "--kv-cache-memory-bytes", str(a.device_bytes)]
        out = [("stock", ["--kv-backend", "vllm"]),
               ("stock-bs32", ["--kv-backend", "vllm", "--block-size", "32"]),
               ("ulacache-arena", ["--kv-backend", "ulacache"])]
        return [(n, [a.model_path] + args + common) for n, args in out]
    D, H = a.device_bytes, a.host_bytes
    gib = H / (1 << 30)
    common = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
              "--max-num-seqs", str(max(a.concurrency)), "--seed", "0"]
    if a.tp > 1:
        common += ["--tensor-parallel-size", str(a.tp)]
    out = [("stock-D", ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D)]),
           ("stock-D+H", ["--kv-backend", "vllm", "--kv-cache-memory-bytes", str(D + H)])]
    ula = ["--kv-backend", "ulacache", "--kv-cache-memory-bytes", str(D),
           "--ula-host-pool-gib", f"{gib:.6f}"]
    if a.tp > 1:
        out += [("ulacache-replicate", ula + ["--ula-tp-mode", "replicate"]),
                ("ulacache-shard", ula + ["--ula-tp-mode", "shard"])]
    else:
        out.append(("ulacache", ula))
    return [(n, [a.model_path] + args + common) for n, args in out]


def _v4_model() -> str:
    """The tiny DeepSeek-V4 of the model factory (built under models_cache/ if absent)."""
    from ulacache_vllm.models import build_model

    path = Path(__file__).resolve().parents[1] / "models_cache" / "bench-deepseek-v4"
    if not (path / "config.json").exists():
        build_model("deepseek_v4", path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="DSA model (default: the embedded tiny one)")
    ap.add_argument("--hybrid", choices=("qwen3_next", "gpt_oss"), default=None,
                    help="sweep a tiny hybrid model instead (stock, stock --block-size 32, "
                         "the ulacache arena at one KV budget --device-bytes)")
    ap.add_argument("--v4", action="store_true",
                    help="sweep the tiny DeepSeek-V4 (stock with D, stock with D + H, the v4 "
                         "line with D on the device and its CSA rows' host pool H)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-bytes", type=int, default=12_000_000, help="D: device KV budget")
    ap.add_argument("--host-bytes", type=int, default=24_000_000, help="H: host pool")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--prompts-per-level", type=int, default=3,
                    help="prompts per point = this x the concurrency")
    ap.add_argument("--point-timeout", type=float, default=1800)
    ap.add_argument("--quick", action="store_true",
                    help="a few small points (concurrency 1, 4, 12; 256 in / 32 out)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    if a.quick:
        a.concurrency, a.input_len, a.output_len, a.prompts_per_level = [1, 4, 12], 256, 32, 2
    if a.hybrid:
        from hybrid_capacity import MODELS, _model_path

        if a.tp > 1:
            ap.error("--hybrid runs with --tp 1 here (the engine runs the arena at TP > 1; this "
                     "sweep's hybrid configurations are not sized for it yet)")
        a.model = a.model or _model_path(a.hybrid)
        a.dtype = MODELS[a.hybrid]["dtype"]
        if a.device_bytes == ap.get_default("device_bytes"):
            a.device_bytes = 64 << 20
    if a.v4:
        if a.hybrid or a.tp > 1:
            ap.error("--v4 runs alone, at --tp 1 (the v4 line refuses tensor parallelism)")
        a.model = a.model or _v4_model()
        a.dtype = "bfloat16"  # (V4's CPU kernels take bfloat16 only)
        if a.device_bytes == ap.get_default("device_bytes"):
            a.device_bytes = 96 << 20
    if a.model is None:
        from capacity import _build_default_model

        a.model = _build_default_model()
    a.model_path = a.model
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if a.tp > 1 and (os.cpu_count() or 1) <= a.tp:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(a.tp)))
    configs = configurations(a)
    points = []
    tmp = Path(tempfile.mkdtemp(prefix="sweep_"))
    bar = tqdm(total=len(configs) * len(a.concurrency), desc="sweep", unit="point")
    for name, args in configs:
        bar.set_postfix_str(f"{name}: starting")
        with Server(args, tmp / f"{name}.log", env, timeout=600) as srv:
            for c in a.concurrency:
                bar.set_postfix_str(f"{name} c={c}")
                scraper = Scraper(srv.base)
                scraper.start()
                try:
                    res = bench_point(srv.base, a.model, c, a, tmp, env)
                finally:
                    scraped = scraper.stop()
                points.append({"config": name, "concurrency": c, **res,
                               "metrics": scraped, "server": " ".join(args)})
                bar.update(1)
    bar.close()
    from _host import cpu_host

    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    print(f"{'config':<20} {'conc':>5} {'out tok/s':>10} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'TTFT p50':>9} {'running max':>11} {'preempt':>8}")
    for p in points:
        m = p["metrics"]
        print(f"{p['config']:<20} {p['concurrency']:>5} {p['output_throughput'] or 0:>10.1f} "
              f"{p['median_tpot_ms'] or 0:>9.2f} {p['p99_tpot_ms'] or 0:>9.2f} "
              f"{p['median_ttft_ms'] or 0:>9.1f} {m['vllm:num_requests_running']:>11.0f} "
              f"{m['vllm:num_preemptions_total']:>8.0f}")
    stem = ("sweep" + (f"_{a.hybrid}" if a.hybrid else "") + ("_v4" if a.v4 else "")
            + (f"_tp{a.tp}" if a.tp > 1 else ""))
    out = Path(a.out) / (stem + ("_quick" if a.quick else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    args = {k: v for k, v in vars(a).items() if k != "model_path"}
    out.with_suffix(".json").write_text(json.dumps(
        {"args": args, "host": host, "points": points}, indent=2, default=str))
    plot(points, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name in dict.fromkeys(p["config"] for p in points):
        ps = [p for p in points if p["config"] == name]
        c = [p["concurrency"] for p in ps]
        ax[0].plot(c, [p["output_throughput"] or 0 for p in ps], "o-", label=name)
        ax[1].plot(c, [p["median_tpot_ms"] or 0 for p in ps], "o-", label=f"{name} p50")
        ax[1].plot(c, [p["p99_tpot_ms"] or 0 for p in ps], "x--", label=f"{name} p99")
        ax[2].plot(c, [p["metrics"]["vllm:num_requests_running"] for p in ps], "o-", label=name)
    for a_, title in zip(ax, ("output tokens / s", "TPOT (ms)", "running requests (max)")):
        a_.set_xscale("log", base=2)
        a_.set_xlabel("max concurrency")
        a_.set_title(title)
        a_.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
