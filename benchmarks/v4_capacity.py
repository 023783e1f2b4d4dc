"""DeepSeek-V4 capacity at equal KV memory: stock vLLM against `--kv-backend ulacache`.

The tiny DeepSeek-V4 (every layer kind once: sliding window only, CSA, HCA) in the real engine
on vLLM's CPU build, one KV byte budget (``kv_cache_memory_bytes``) for both, each engine in its
own subprocess (this script re-invoked with ``--worker``, engine core in-process so the worker
reads the scheduler). A batch of long requests (random token ids over 2048 tokens, so the
real indexer selects the top 512 compressed rows) is submitted at once; per step the worker
records the running and waiting requests, and the KV bytes in use (stock: blocks in use x its
block stride, the widest group's page; ulacache: the arena's used bytes: the CSA compressed
rows live in their own device + host pools, the logical address space, and are not counted
there; their device pool is, in the bound below).

Printed side by side, from one invocation: peak and mean running requests, preemptions, the
KV bytes one running request holds in decode (median over decode-only steps of bytes in use /
running), wall time and output tokens/s, whether the greedy tokens are identical, and
ulacache's peak against the physical bound (the KV budget less the CSA device rows and the
null page, over one decoding request's device bytes at natural page sizes). Where the
figure comes from: stock pads every page of every group to its widest group's (`kv cache group
sizes` in its log); the arena keeps each at its own size (the ulacache startup line).

    python benchmarks/v4_capacity.py                       # ~5 minutes on 2 cores
    python benchmarks/v4_capacity.py --kv-mib 160 --requests 16

Writes ``results/v4_capacity.json`` (``--tag`` adds a suffix) and appends nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
MARK = "@@V4_CAPACITY@@"
MiB = 1 << 20


def _worker(cfg: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["model"], dtype="bfloat16", enforce_eager=True, seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              kv_cache_memory_bytes=cfg["kv_bytes"], kv_backend=cfg["backend"],
              enable_prefix_caching=cfg.get("prefix_caching", False), disable_log_stats=False,
              **({"ula_v4_csa_device_rows": cfg["csa_device_rows"]}
                 if cfg["backend"] == "ulacache" and cfg.get("csa_device_rows") else {}))
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    sched = core.scheduler
    ula = cfg["backend"] == "ulacache"
    pool = sched.kv_cache_manager.block_pool
    kvc = sched.kv_cache_config
    block_bytes = (max(t.block_stride for t in kvc.kv_cache_tensors) if not ula else None)

    def used_bytes() -> int:
        if ula:  # (the null page: never a request's; cached free pages: free, as stock's)
            mgr = sched.kv_cache_manager
            a = mgr.arena
            return int(a.used_bytes - a.page_bytes[0] - mgr._state.cached_free_bytes())
        return (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * block_bytes

    rng = random.Random(cfg["seed"])
    sp = SamplingParams(temperature=0, max_tokens=cfg["output_tokens"], ignore_eos=True)
    for i in range(cfg["requests"]):
        n = cfg["prompt_tokens"] + rng.randrange(0, 200)
        eng.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(n)]},
                        sp)
    steps, done, t0 = [], {}, time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        running, waiting = len(sched.running), len(sched.waiting)
        prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        steps.append((running, waiting, used_bytes(), prefill))
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    preempt = sum(getattr(m, "value", 0) for m in llm.get_metrics()
                  if m.name == "vllm:num_preemptions")
    decode = [b / r for r, _, b, p in steps if r and not p]
    extra = {}
    if ula and getattr(sched.kv_cache_manager.layout, "csa", None) is not None:
        lay = sched.kv_cache_manager.layout
        use = llm.collective_rpc("ulacache_usage")[0]
        extra["csa"] = use["csa"]
        # compressor states of prefill chunks kept in the step scratch (outside the budget)
        extra["state_scratch_tokens"] = use.get("state_scratch_tokens", 0)
        extra["state_scratch_bytes"] = use.get("state_scratch_bytes", 0)
        extra["csa_device_bytes"] = lay.csa.device_bytes
        extra["null_page_bytes"] = lay.null_page_bytes
        if decode:  # the physical bound: the budget less the CSA device rows and the null
            # page, over one decoding request's device bytes (its pages at natural size: the
            # window, the compressor states, the indexer keys, the HCA rows; no CSA row)
            extra["bound_running"] = ((cfg["kv_bytes"] - lay.csa.device_bytes
                                       - lay.null_page_bytes) / statistics.median(decode))
    return dict(backend=cfg["backend"], steps=len(steps), wall_s=wall, **extra,
                peak_running=max(r for r, *_ in steps),
                mean_running=statistics.mean(r for r, *_ in steps),
                preemptions=preempt,
                decode_bytes_per_request=statistics.median(decode) if decode else None,
                out_tok_s=sum(len(t) for t in done.values()) / wall,
                tokens=[done[f"r{i}"] for i in range(cfg["requests"])],
                block_bytes=block_bytes)


def _spawn(cfg: dict) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                         capture_output=True, text=True, timeout=cfg["timeout"])
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"backend": cfg["backend"], "failed": True, "stderr_tail": out.stderr[-4000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="a DeepSeek-V4 checkpoint (default: the "
                    "tiny V4, built under models_cache/ if absent)")
    ap.add_argument("--compress-ratios", default=None, metavar="R,R,...",
                    help="the tiny V4's layer schedule (default: the factory's 0,4,128: one "
                    "layer of each kind); e.g. 0,4,128,4,128,4,128,4")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="another tiny V4 shape: any config key, as `python -m "
                    "ulacache_vllm.models build deepseek_v4 --set` (repeatable)")
    ap.add_argument("--kv-mib", type=int, default=128, help="KV budget, both sides (MiB)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=2100)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=3072)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--csa-device-rows", type=int, default=0,
                    help="ulacache: --ula-v4-csa-device-rows (default 0: the line's default)")
    ap.add_argument("--ula-less-mib", type=float, default=0.0,
                    help="ulacache's KV budget this much smaller than stock's (e.g. its state "
                    "scratch, for equal total memory)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="vLLM's prefix caching on for both (its default for V4 on AMX hosts; "
                    "the prompts share nothing, so what it changes is what each side keeps)")
    ap.add_argument("--timeout-s", type=int, default=1800,
                    help="each side's limit (the lab's emulated kernels need more than the "
                    "default for the 8-layer runs)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.worker)
        print(MARK + json.dumps(_worker(cfg)), flush=True)
        return
    model = args.model
    if model is None:
        from ulacache_vllm.models import build_model
        from ulacache_vllm.models.__main__ import _parse_set

        ratios = ([int(x) for x in args.compress_ratios.split(",")]
                  if args.compress_ratios else None)
        overrides = dict(compress_ratios=ratios, num_hidden_layers=len(ratios)) if ratios \
            else {}
        sets = _parse_set(args.set)
        overrides.update(sets)
        name = "bench-deepseek-v4" + ("-" + "-".join(map(str, ratios)) if ratios else "") + (
            "-" + re.sub(r"[^\w.-]", "", "-".join(f"{k}{v}" for k, v in sorted(sets.items())))
            if sets else "")
        path = REPO / "models_cache" / name
        if not (path / "config.json").exists():
            build_model("deepseek_v4", path, overrides=overrides or None)
        model = str(path)
    base = dict(model=model, kv_bytes=args.kv_mib * MiB, requests=args.requests,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=0,
                timeout=args.timeout_s, csa_device_rows=args.csa_device_rows,
                prefix_caching=args.prefix_caching)
    ula_kv = int((args.kv_mib - args.ula_less_mib) * MiB)
    res = {b: _spawn({**base, "backend": b, **({"kv_bytes": ula_kv} if b == "ulacache" else {})})
           for b in ("vllm", "ulacache")}
    for r in res.values():
        if r.get("failed"):
            print(r["backend"], "FAILED\n", r["stderr_tail"])
            sys.exit(1)
    s, u = res["vllm"], res["ulacache"]
    same = s["tokens"] == u["tokens"]
    rows = [("peak running requests", "peak_running", "{:.0f}"),
            ("mean running requests", "mean_running", "{:.2f}"),
            ("preemptions", "preemptions", "{:.0f}"),
            ("KV bytes per running request (decode)", "decode_bytes_per_request", "{:,.0f}"),
            ("steps", "steps", "{:.0f}"), ("wall s", "wall_s", "{:.1f}"),
            ("output tok/s", "out_tok_s", "{:.1f}")]
    layers = args.compress_ratios or ("" if any(x.startswith("compress_ratios=")
                                                for x in args.set) else "0,4,128")
    print(f"\nDeepSeek-V4 (tiny, layers {layers}"
          f"{'; ' + ', '.join(args.set) if args.set else ''}) at {args.kv_mib} "
          f"MiB KV, {args.requests} requests of "
          f"{args.prompt_tokens}-{args.prompt_tokens + 199} prompt + {args.output_tokens} output "
          f"tokens, max_num_seqs {args.max_num_seqs}, prefix caching "
          f"{'on' if args.prefix_caching else 'off'}" + (
              f"; ulacache's KV budget {args.kv_mib - args.ula_less_mib:g} MiB"
              if args.ula_less_mib else ""))
    print(f"{'':40s} {'stock vLLM':>14s} {'ulacache':>14s} {'ratio':>8s}")
    for label, key, fmt in rows:
        a, b = s[key], u[key]
        ratio = f"{b / a:.2f}x" if a else "-"
        print(f"{label:40s} {fmt.format(a):>14s} {fmt.format(b):>14s} {ratio:>8s}")
    print(f"greedy tokens identical: {same}; stock block stride {s['block_bytes']:,} B")
    if "bound_running" in u:
        c = u["csa"]
        print(f"physical bound (budget less the CSA device rows and the null page, over one "
              f"decoding request's device bytes): {u['bound_running']:.1f} running requests; "
              f"ulacache's peak is {u['peak_running'] / u['bound_running']:.2f} of it")
        print(f"CSA rows: {c['device_rows']} device rows per layer ({u['csa_device_bytes']:,} B "
              f"in all), demotions {c['demotions']}, promotions {c['promotions']}, settle "
              f"overflows {c['settle_overflows']}")
        print(f"compressor states kept in the step scratch: {u.get('state_scratch_tokens', 0):,} "
              f"token-states; the scratch buffer (outside the KV budget) peaked at "
              f"{u.get('state_scratch_bytes', 0):,} B")
    out = RESULTS / f"v4_capacity{args.tag}.json"
    for r in res.values():
        r.pop("tokens")
    json.dump(dict(args=vars(args), identical=same, results=res), open(out, "w"), indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
