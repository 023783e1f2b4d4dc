"""Capacity benchmark: admitted concurrent requests and throughput at equal memory.

One long-prompt workload (KV dominates) under one total budget D + H, three configurations
measured side by side in one run, each in its own engine process:

  stock-D      stock vLLM, KV budget D on the device only
  stock-D+H    stock vLLM, D + H all on the device (the physical upper bound)
  ulacache     --kv-backend ulacache, D on the device and H in the host pool

Reports the peak number of simultaneously running requests, output tokens/s, mean decode-step
time at equal batch size, and batch-1 TPOT with everything on the device (ulacache's fast
path) against stock. Prints a table, writes JSON + a plot (``capacity[_quick].{json,png}``)
into ``--out`` (a directory, default benchmarks/results/).

``--tp P --spec mtp[:K]``: speculative decoding with the same settings on every
configuration (default: the tiny DeepSeek-V3.2 built with one MTP layer, drafting K=2 tokens):
stock TP=P against ulacache TP=P shard and replicate at equal per-rank memory; reports peak
running requests, output tokens/s, drafts proposed/accepted during the load (vLLM's
``vllm:spec_decode_*`` counters) and whether the load's greedy outputs equal stock's, token
for token (``capacity_tp{P}_spec_mtp[_quick].{json,png}``).

    python benchmarks/capacity.py --quick
    python benchmarks/capacity.py --model /path/to/dsa-model --device-bytes 8589934592 \
        --host-bytes 34359738368
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
MARK = "@@CAPACITY@@"


# ----------------------------------------------------------------------------- worker side
def _worker(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw = dict(kv_cache_memory_bytes=cfg["kv_bytes"], kv_backend=cfg["backend"])
    if cfg["backend"] == "ulacache":
        kw["ula_host_pool_gib"] = cfg["host_bytes"] / (1 << 30)
        if cfg.get("tp_mode"):
            kw["ula_tp_mode"] = cfg["tp_mode"]
    if cfg.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = cfg["tp"]
    if cfg.get("spec"):
        kw["speculative_config"] = cfg["spec"]
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              disable_log_stats=False, **kw)
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
             "omicron pi rho sigma tau upsilon phi chi psi omega").split()

    def prompt(i, n_tokens):
        text, j = [], 0
        while len(tok.encode(" ".join(text))) < n_tokens:
            text.append(words[(i * 5 + j * 3) % len(words)])
            j += 1
        return " ".join(text)

    def spec_counts():  # vLLM's speculative-decoding counters (log stats on)
        return {m.name[len("vllm:spec_decode_"):]: m.value for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                              "vllm:spec_decode_num_accepted_tokens")}

    def run(prompts, max_tokens):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = {}
        for i, p in enumerate(prompts):
            rid = f"r{time.monotonic_ns()}-{i}"
            ids[rid] = i
            eng.add_request(rid, p, sp)
        tokens: list = [None] * len(prompts)
        peak, step_times, batch_sizes, decode_only = 0, [], [], []
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            s = time.perf_counter()
            outs = eng.step()
            step_times.append(time.perf_counter() - s)
            batch_sizes.append(len(outs))
            peak = max(peak, len(outs))
            # A step that produced some request's first token ran a prefill.
            decode_only.append(all(len(o.outputs[0].token_ids) > 1 for o in outs) and bool(outs))
            for o in outs:
                if o.finished:
                    tokens[ids[o.request_id]] = list(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        return {"peak_running": peak, "wall_s": wall, "step_times": step_times,
                "batch_sizes": batch_sizes, "decode_only": decode_only, "tokens": tokens}

    res = {"name": cfg["name"]}
    if cfg.get("tpot_only"):  # interleaved batch-1 TPOT rounds (--tp): one run per engine
        one = run([prompt(999, 64)], cfg["tpot_tokens"])
        res["tpot_ms"] = 1000 * statistics.median(
            [t for t, d in zip(one["step_times"], one["decode_only"]) if d])
        return res
    prompts = [prompt(i, cfg["prompt_tokens"]) for i in range(cfg["num_requests"])]
    s0 = spec_counts() if cfg.get("spec") else None
    load = run(prompts, cfg["output_tokens"])
    if s0 is not None:  # drafts proposed and accepted during the load alone
        sd = {k: v - s0.get(k, 0) for k, v in spec_counts().items()}
        sd["acceptance"] = sd.get("num_accepted_tokens", 0) / max(1, sd.get("num_draft_tokens", 0))
        res["spec_decode"] = sd
        res["load_tokens"] = load["tokens"]
    if cfg["backend"] == "ulacache":  # before the equal-batch and TPOT runs add their own
        res["load_tiers"] = llm.collective_rpc("ulacache_usage")[0]["totals"]
    res["peak_running"] = load["peak_running"]
    res["output_tok_s"] = cfg["num_requests"] * cfg["output_tokens"] / load["wall_s"]
    # Decode-step time at each batch size seen (steps that ran a prefill excluded).
    per_bs: dict[int, list[float]] = {}
    for t, b, d in zip(load["step_times"], load["batch_sizes"], load["decode_only"]):
        if d:
            per_bs.setdefault(b, []).append(t)
    res["step_ms_by_batch"] = {str(b): 1000 * statistics.median(v) for b, v in per_bs.items()}
    # Equal batch size in every configuration: a batch small enough for stock-D to hold.
    eq = run([prompt(500 + i, cfg["eq_prompt_tokens"]) for i in range(cfg["eq_batch"])], 32)
    res["eq_batch_step_ms"] = 1000 * statistics.median(
        [t for t, d, b in zip(eq["step_times"], eq["decode_only"], eq["batch_sizes"])
         if d and b == cfg["eq_batch"]])
    # Batch-1 TPOT with a short prompt: everything fits on the device.
    one = run([prompt(999, 64)], cfg["tpot_tokens"])
    res["tpot_ms"] = 1000 * statistics.median(
        [t for t, d in zip(one["step_times"], one["decode_only"]) if d])
    if cfg["backend"] == "ulacache":
        ranks = llm.collective_rpc("ulacache_usage")
        res["usage"] = ranks[0]
        res["token_capacity"] = ranks[0]["num_logical"]
        shards = ranks[0].get("tp_world", 1) if ranks[0].get("tp_mode") == "shard" else 1
        groups = len(ranks[0]["victim_paths"])
        res["device_tokens"] = shards * ranks[0]["device_capacity"] // groups
        res["remote"] = [{k: u["totals"][k] for k in ("remote_rows_fetched", "remote_hits",
                                                      "remote_lookups")} for u in ranks]
    else:
        cc = llm.llm_engine.vllm_config.cache_config
        res["token_capacity"] = res["device_tokens"] = cc.num_gpu_blocks * cc.block_size
    from _host import engine_path

    res["engine_path"] = engine_path(llm, res.get("usage"))
    return res


# ----------------------------------------------------------------------------- driver side
def _spawn(cfg: dict) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if cfg.get("tp", 1) > 1 and (os.cpu_count() or 1) <= cfg["tp"]:
        # One OpenMP thread per rank on a small host (vLLM's CPU default reserves cores).
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg["tp"])))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                                    env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=cfg["timeout"])
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"{cfg['name']} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")


def _build_default_model(mtp: bool = False) -> str:
    """The tiny DeepSeek-V3.2; ``mtp``: built with one MTP layer (its own draft model)."""
    from ulacache_vllm.models import build_model

    path = Path(__file__).resolve().parents[1] / "models_cache" / (
        "bench-deepseek-v32" + ("-mtp" if mtp else ""))
    if not (path / "config.json").exists():
        build_model("deepseek_v32", path,
                    overrides={"num_nextn_predict_layers": 1} if mtp else None)
    return str(path)


def _print_remote(results: dict) -> None:
    """Per configuration with TP shard rows: remote rows fetched / buffer hits per rank."""
    for name, r in results.items():
        if "remote" in r:
            print(f"  {name}: remote rows fetched / buffer hits per rank: "
                  + ", ".join(f"{x['remote_rows_fetched']}/{x['remote_hits']}" for x in r["remote"]))


def _spec_config(arg: str | None) -> dict | None:
    """``--spec METHOD[:K]`` as vLLM's speculative_config (None without one)."""
    from _spec import spec_config

    return spec_config(arg) or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="DSA model (default: embedded tiny DeepSeek-V3.2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device-bytes", type=int, default=12_000_000, help="D: device KV budget")
    ap.add_argument("--host-bytes", type=int, default=24_000_000, help="H: host pool")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--tpot-tokens", type=int, default=64)
    ap.add_argument("--eq-batch", type=int, default=4, help="batch for the equal-batch step time")
    ap.add_argument("--eq-prompt-tokens", type=int, default=256)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: stock TP=P vs "
                    "ulacache TP=P replicate and shard at equal per-rank memory (D and H per rank)")
    ap.add_argument("--tpot-rounds", type=int, default=2,
                    help="--tp: extra interleaved batch-1 TPOT runs per config (medians reported)")
    ap.add_argument("--spec", default=None, metavar="METHOD[:K]",
                    help="--tp: speculative decoding on every config, mtp[:K] (default model: "
                    "the tiny V3.2 with one MTP layer; K default 2) or ngram[:K]; configs "
                    "stock, ula replicate and shard (minimal host pools), no TPOT rounds")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON and the plot")
    args = ap.parse_args()
    if args.worker:
        res = _worker(json.loads(args.worker))
        print(MARK + json.dumps(res), flush=True)
        return
    if args.tp > 1:
        return main_tp_spec(args) if args.spec else main_tp(args)
    if args.spec:
        ap.error("--spec needs --tp P > 1")
    if args.quick:
        args.num_requests, args.output_tokens, args.tpot_tokens = 12, 16, 32
    model = args.model or _build_default_model()
    base = dict(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=max(args.num_requests, 1), num_requests=args.num_requests,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                tpot_tokens=args.tpot_tokens, host_bytes=args.host_bytes, timeout=1800,
                eq_batch=args.eq_batch, eq_prompt_tokens=args.eq_prompt_tokens)
    D, H = args.device_bytes, args.host_bytes
    configs = [
        dict(base, name="stock-D", backend="vllm", kv_bytes=D),
        dict(base, name="stock-D+H", backend="vllm", kv_bytes=D + H),
        dict(base, name="ulacache", backend="ulacache", kv_bytes=D),
    ]
    results = {c["name"]: _spawn(c) for c in configs}
    upper = results["stock-D+H"]["peak_running"]
    ula, stock = results["ulacache"], results["stock-D"]
    common = sorted(set(ula["step_ms_by_batch"]) & set(stock["step_ms_by_batch"]), key=int)
    summary = {
        "ulacache_vs_upper_bound_requests": ula["peak_running"] / max(1, upper),
        "ulacache_vs_stock_D_requests": ula["peak_running"] / max(1, stock["peak_running"]),
        "tpot_ratio_ulacache_vs_stock": ula["tpot_ms"] / stock["tpot_ms"],
        "step_ms_equal_batch": {b: {"stock-D": stock["step_ms_by_batch"][b],
                                    "ulacache": ula["step_ms_by_batch"][b]} for b in common},
        "eq_batch_step_ms": {n: r["eq_batch_step_ms"] for n, r in results.items()},
    }
    from _host import cpu_host

    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    for name, r in results.items():
        p = r["engine_path"]
        print(f"  {name:<10} block {p['block_size']}, chunked prefill {p['chunked_prefill']}, "
              f"prefix caching {p['prefix_caching']}, max_num_batched_tokens "
              f"{p['max_num_batched_tokens']}"
              + (f" (lowered from {p['max_num_batched_tokens_default']})"
                 if "max_num_batched_tokens_default" in p else ""))
    print(f"\nworkload: {args.num_requests} requests x {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens; D={D} B device, H={H} B host\n")
    print(f"{'config':<18} {'peak running':>12} {'out tok/s':>10} {'TPOT b=1 ms':>12}")
    for name, r in results.items():
        print(f"{name:<18} {r['peak_running']:>12} {r['output_tok_s']:>10.1f} {r['tpot_ms']:>12.2f}")
    print(f"\nulacache admits {summary['ulacache_vs_upper_bound_requests']:.0%} of the upper "
          f"bound's concurrent requests ({summary['ulacache_vs_stock_D_requests']:.2f}x stock-D); "
          f"batch-1 TPOT ratio ulacache/stock = {summary['tpot_ratio_ulacache_vs_stock']:.3f}")
    print(f"decode step ms at batch {args.eq_batch} (all configs): " + ", ".join(
        f"{n} {v:.2f}" for n, v in summary["eq_batch_step_ms"].items()))
    print("decode step ms at equal batch size seen in the load (stock-D vs ulacache):")
    for b, v in summary["step_ms_equal_batch"].items():
        print(f"  batch {b:>3}: {v['stock-D']:.2f} vs {v['ulacache']:.2f}")
    print("tier traffic during the load (ulacache):", ula.get("load_tiers"))
    out = Path(args.out) / ("capacity_quick" if args.quick else "capacity")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "host": host, "results": results, "summary": summary}, indent=2,
        default=str))
    _plot(results, summary, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _min_host_bytes(model: str, max_model_len: int, shards: int, dtype: str) -> int:
    """The smallest host pool ulacache accepts: one request's share per rank (+ a block)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    layers = cfg["num_hidden_layers"] + int(cfg.get("num_nextn_predict_layers") or 0)
    row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return (-(-max_model_len // shards) + 128) * layers * row * size


def main_tp(args) -> None:
    """``--tp P``: stock TP=P against ulacache TP=P replicate and shard, D (and H) per rank."""
    P = args.tp
    if args.quick:
        args.num_requests, args.output_tokens, args.tpot_tokens = 24, 16, 32
    model = args.model or _build_default_model()
    base = dict(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=max(args.num_requests, 1), num_requests=args.num_requests,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                tpot_tokens=args.tpot_tokens, timeout=2400, tp=P,
                eq_batch=args.eq_batch, eq_prompt_tokens=args.eq_prompt_tokens)
    D, H = args.device_bytes, args.host_bytes
    h_rep = _min_host_bytes(model, args.max_model_len, 1, args.dtype)
    h_shard = _min_host_bytes(model, args.max_model_len, P, args.dtype)
    t = f"tp{P}"
    configs = [
        dict(base, name=f"stock-{t}", backend="vllm", kv_bytes=D, host_bytes=0),
        dict(base, name=f"stock-{t}-D+H", backend="vllm", kv_bytes=D + H, host_bytes=0),
        dict(base, name=f"ula-{t}-replicate", backend="ulacache", kv_bytes=D,
             host_bytes=h_rep, tp_mode="replicate"),
        dict(base, name=f"ula-{t}-shard", backend="ulacache", kv_bytes=D,
             host_bytes=h_shard, tp_mode="shard"),
        dict(base, name=f"ula-{t}-replicate-host", backend="ulacache", kv_bytes=D,
             host_bytes=H, tp_mode="replicate"),
        dict(base, name=f"ula-{t}-shard-host", backend="ulacache", kv_bytes=D,
             host_bytes=H, tp_mode="shard"),
    ]
    results = {}
    for c in configs:
        print(f"running {c['name']} ...", flush=True)
        results[c["name"]] = _spawn(c)
    # Batch-1 TPOT again in interleaved rounds (engine-to-engine noise on a small host is
    # larger than the effect): the medians over rounds give the ratios.
    rounds = {c["name"]: [results[c["name"]]["tpot_ms"]] for c in configs[:4] if c is not configs[1]}
    for i in range(args.tpot_rounds):
        for c in configs[:4]:
            if c["name"] in rounds:
                print(f"TPOT round {i + 1}: {c['name']} ...", flush=True)
                rounds[c["name"]].append(_spawn(dict(c, tpot_only=True, tpot_tokens=128))["tpot_ms"])
    for name, v in rounds.items():
        results[name]["tpot_rounds_ms"] = v
        results[name]["tpot_ms"] = statistics.median(v)
    stock, bound = results[f"stock-{t}"], results[f"stock-{t}-D+H"]
    shard, shard_h = results[f"ula-{t}-shard"], results[f"ula-{t}-shard-host"]
    rep = results[f"ula-{t}-replicate"]
    summary = {
        "shard_vs_stock_tokens": shard["token_capacity"] / stock["token_capacity"],
        "shard_vs_stock_device_tokens": shard["device_tokens"] / stock["device_tokens"],
        "replicate_vs_stock_tokens": rep["token_capacity"] / stock["token_capacity"],
        # Physical bound of P ranks with D + H each holding distinct tokens at stock's bytes
        # per token: P x what stock holds in D + H (stock replicates, so its TP=P holds 1x).
        "shard_host_vs_physical_bound": shard_h["token_capacity"] / (P * bound["token_capacity"]),
        "shard_vs_stock_peak_running": shard["peak_running"] / max(1, stock["peak_running"]),
        "tpot_ratio_shard_vs_stock": shard["tpot_ms"] / stock["tpot_ms"],
        "tpot_ratio_replicate_vs_stock": rep["tpot_ms"] / stock["tpot_ms"],
    }
    from _host import cpu_host

    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    print(f"workload: {args.num_requests} requests x {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens; TP={P}; per rank D={D} B device, H={H} B host "
          f"(minimal host pools: replicate {h_rep} B, shard {h_shard} B)\n")
    print(f"{'config':<24} {'tokens':>8} {'on device':>9} {'peak running':>12} {'out tok/s':>10} "
          f"{'TPOT b=1 ms':>12}")
    for name, r in results.items():
        print(f"{name:<24} {r['token_capacity']:>8} {r['device_tokens']:>9} {r['peak_running']:>12} "
              f"{r['output_tok_s']:>10.1f} {r['tpot_ms']:>12.2f}")
    print(f"\nshard holds {summary['shard_vs_stock_tokens']:.2f}x the tokens of stock TP={P} "
          f"({summary['shard_vs_stock_device_tokens']:.2f}x on the device alone) "
          f"(replicate {summary['replicate_vs_stock_tokens']:.2f}x); with the host pool "
          f"{summary['shard_host_vs_physical_bound']:.0%} of the physical bound P*(D+H); "
          f"batch-1 TPOT shard/stock = {summary['tpot_ratio_shard_vs_stock']:.3f}, "
          f"replicate/stock = {summary['tpot_ratio_replicate_vs_stock']:.3f}")
    _print_remote(results)
    out = Path(args.out) / (f"capacity_tp{P}_quick" if args.quick else f"capacity_tp{P}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "host": host, "results": results, "summary": summary}, indent=2,
        default=str))
    _plot_tp(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def main_tp_spec(args) -> None:
    """``--tp P --spec``: stock TP=P, ulacache TP=P replicate and shard (minimal host pools, D
    per rank), all with the same speculative_config; load figures, drafts and token identity."""
    P, spec = args.tp, _spec_config(args.spec)
    if args.quick:
        args.num_requests, args.output_tokens, args.tpot_tokens = 24, 16, 32
    model = args.model or _build_default_model(mtp=spec["method"] == "mtp")
    base = dict(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=max(args.num_requests, 1), num_requests=args.num_requests,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                tpot_tokens=args.tpot_tokens, timeout=2400, tp=P, spec=spec,
                eq_batch=args.eq_batch, eq_prompt_tokens=args.eq_prompt_tokens)
    D = args.device_bytes
    h_rep = _min_host_bytes(model, args.max_model_len, 1, args.dtype)
    h_shard = _min_host_bytes(model, args.max_model_len, P, args.dtype)
    t = f"tp{P}"
    configs = [
        dict(base, name=f"stock-{t}", backend="vllm", kv_bytes=D, host_bytes=0),
        dict(base, name=f"ula-{t}-replicate", backend="ulacache", kv_bytes=D,
             host_bytes=h_rep, tp_mode="replicate"),
        dict(base, name=f"ula-{t}-shard", backend="ulacache", kv_bytes=D,
             host_bytes=h_shard, tp_mode="shard"),
    ]
    results, failed = {}, {}
    for c in configs:
        print(f"running {c['name']} ...", flush=True)
        t0 = time.perf_counter()
        try:
            results[c["name"]] = _spawn(c)
            results[c["name"]]["process_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - keep the other configs' figures
            failed[c["name"]] = str(e)[-6000:]
            print(f"  FAILED: {failed[c['name']]}", flush=True)
    stock = results.get(f"stock-{t}")
    for name, r in results.items():
        if stock is not None and name != stock["name"]:
            r["load_tokens_identical_to_stock"] = r["load_tokens"] == stock["load_tokens"]
    from _host import cpu_host

    host = cpu_host()
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), vLLM CPU MLA path: {host['mla_path']}")
    print(f"workload: {args.num_requests} requests x {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens; TP={P}; per rank D={D} B device (minimal host "
          f"pools: replicate {h_rep} B, shard {h_shard} B); speculative_config {json.dumps(spec)}\n")
    print(f"{'config':<20} {'tokens':>7} {'peak running':>12} {'out tok/s':>9} {'drafts':>7} "
          f"{'draft tok':>9} {'accepted':>8} {'rate':>6} {'TPOT b=1':>8}  same tokens as stock")
    for name, r in results.items():
        sd = r.get("spec_decode") or {}
        print(f"{name:<20} {r['token_capacity']:>7} {r['peak_running']:>12} "
              f"{r['output_tok_s']:>9.1f} {sd.get('num_drafts', 0):>7.0f} "
              f"{sd.get('num_draft_tokens', 0):>9.0f} {sd.get('num_accepted_tokens', 0):>8.0f} "
              f"{sd.get('acceptance', 0):>6.3f} {r['tpot_ms']:>8.2f}  "
              f"{r.get('load_tokens_identical_to_stock', '-')}")
    _print_remote(results)
    summary = {}
    if stock is not None:
        for name, r in results.items():
            if name != stock["name"]:
                summary[name] = {
                    "tokens_vs_stock": r["token_capacity"] / stock["token_capacity"],
                    "peak_running_vs_stock": r["peak_running"] / max(1, stock["peak_running"]),
                    "output_tok_s_vs_stock": r["output_tok_s"] / stock["output_tok_s"],
                    "load_tokens_identical_to_stock": r["load_tokens_identical_to_stock"]}
    out = Path(args.out) / (f"capacity_tp{P}_spec_{spec['method']}"
                            + ("_quick" if args.quick else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "host": host, "loadavg_end": os.getloadavg(), "spec": spec,
         "results": results, "failed": failed, "summary": summary}, indent=2, default=str))
    if results:
        _plot_tp(results, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def _plot_tp(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for a, key, title in zip(ax, ("token_capacity", "output_tok_s", "tpot_ms"),
                             ("KV tokens held", "output tokens / s", "TPOT, batch 1 (ms)")):
        a.bar(range(len(names)), [results[n][key] for n in names], color="#2a7")
        a.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        a.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot(results, summary, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(1, 3, figsize=(13, 4))
    colors = ["#999", "#555", "#2a7", "#bbb"][: len(names)]
    ax[0].bar(names, [results[n]["peak_running"] for n in names], color=colors)
    ax[0].set_title("peak concurrent requests")
    ax[1].bar(names, [results[n]["output_tok_s"] for n in names], color=colors)
    ax[1].set_title("output tokens / s")
    x = range(len(names))
    ax[2].bar([i - 0.2 for i in x], [results[n]["tpot_ms"] for n in names], 0.4,
              label="TPOT, batch 1")
    ax[2].bar([i + 0.2 for i in x], [results[n]["eq_batch_step_ms"] for n in names], 0.4,
              label="decode step, equal batch")
    ax[2].set_xticks(list(x), names)
    ax[2].set_ylabel("ms")
    ax[2].legend()
    ax[2].set_title("per-step latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
