#!/usr/bin/env python3
"""End-to-end check of ulacache's EXPERIMENTAL CUDA path, for a GPU owner (issue 33 item 4).

Needs an NVIDIA GPU of compute capability 9.x or 10.x (H100/H200, B200/B300), vLLM 0.32.0 built
for CUDA, DeepGEMM (vLLM's DeepSeek-V3.2 indexer needs it) and this repository installed
(``pip install -e .``). It has never been run: no GPU with vLLM was available where it was written.

What it does: builds a local tiny DeepSeek-V3.2 model with a CUDA-legal shape (kv_lora 512 + rope
64, index_topk 128, 64 indexer heads of 128, 16 heads, hidden 512, 3 layers; random weights, local
tokenizer, no downloads), then for each of {bf16, fp8} x {eager, piecewise graphs} runs stock
vLLM and then ``--kv-backend ulacache`` (``ULACACHE_EXPERIMENTAL_CUDA=1``) on the same greedy
workload, each engine in its own subprocess (GPU memory is returned between engines). ulacache
runs under pressure: a device pool of about ``--device-tokens`` rows per layer and a small host
pool, so rows are demoted and promoted while the prompts run.

It prints, per configuration: token parity against stock (every prompt's greedy tokens equal),
ulacache's promotions / demotions / staged rows, the batch-1 TPOT ratio (ulacache / stock over
``--tpot-tokens`` tokens), and a short concurrency sweep (output tokens/s at each
``--concurrency``, ulacache / stock). Exit status: 0 when every configuration is token-exact and
shows promotions > 0 and demotions > 0; 1 otherwise; 2 when the machine cannot run it (no CUDA,
no vLLM CUDA build, no DeepGEMM), with the reason.

``--plan`` prints the runs as JSON and exits (no GPU needed); the tests use it.
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

REPO = Path(__file__).resolve().parents[1]
OPT_IN_ENV = "ULACACHE_EXPERIMENTAL_CUDA"

# The CUDA-legal tiny shape (cuda-notes section 4): FlashMLA needs head 576 = 512 + 64 and the
# converter a top-k that is a multiple of 128; DeepGEMM's indexer kernels take 64 heads of 128.
CUDA_SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, index_topk=128, index_n_heads=64,
                  index_head_dim=128, num_attention_heads=16, num_key_value_heads=16,
                  hidden_size=512, num_hidden_layers=3)
DTYPES = {"bf16": "auto", "fp8": "fp8"}
GRAPHS = {"eager": {"enforce_eager": True},
          "piecewise": {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                               "cudagraph_capture_sizes": [1, 8, 32]}}}
BLOCK_SIZE = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Pass: every configuration prints 'tokens: PASS' and "
                                       "promotions > 0, demotions > 0; the script exits 0.")
    p.add_argument("--model-dir", default=None,
                   help="where to build the tiny model (default: a temporary directory)")
    p.add_argument("--dtypes", default="bf16,fp8", help="KV cache dtypes: bf16,fp8")
    p.add_argument("--graphs", default="eager,piecewise",
                   help="eager (enforce_eager) and/or piecewise (FULL_AND_PIECEWISE graphs)")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the parity workload")
    p.add_argument("--prompt-tokens", default="1024,2048", help="min,max prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--device-tokens", type=int, default=1024,
                   help="ulacache device pool rows per layer (pressure); stock gets enough")
    p.add_argument("--host-pool-gib", type=float, default=0.05, help="ulacache host pool")
    p.add_argument("--tpot-tokens", type=int, default=64, help="batch-1 TPOT tokens")
    p.add_argument("--concurrency", default="1,8,32", help="concurrency sweep")
    p.add_argument("--sweep-seconds", type=float, default=20.0, help="seconds per sweep point")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout", type=int, default=900, help="seconds per engine subprocess")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plan", action="store_true", help="print the run plan as JSON and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, allowed in (("dtypes", DTYPES), ("graphs", GRAPHS)):
        bad = [x for x in _csv(getattr(args, name)) if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {', '.join(allowed)}")
    return args


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def kv_bytes_for(tokens: int, dtype: str) -> int:
    """KV budget for ``tokens`` rows per layer: MLA rows plus indexer keys (132 B fp8 + scale)."""
    mla = 656 if dtype == "fp8" else 1152
    return tokens * (mla + 132) * CUDA_SHAPE["num_hidden_layers"]


def build_plan(args: argparse.Namespace) -> list[dict]:
    """The engine runs, in order: stock then ulacache for each (dtype, graphs)."""
    lo, hi = (int(x) for x in _csv(args.prompt_tokens))
    runs = []
    for dtype in _csv(args.dtypes):
        for graphs in _csv(args.graphs):
            common = {"kv_cache_dtype": DTYPES[dtype], "block_size": BLOCK_SIZE,
                      "max_model_len": args.max_model_len, "max_num_seqs": 32,
                      "seed": 0, "enable_prefix_caching": False, **GRAPHS[graphs]}
            stock_tokens = args.prompts * hi + args.max_tokens * args.prompts + 4096
            for backend in ("vllm", "ulacache"):
                kw = dict(common, kv_backend=backend)
                env = {"VLLM_DEEP_GEMM_WARMUP": "skip", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                if backend == "ulacache":
                    kw["kv_cache_memory_bytes"] = kv_bytes_for(args.device_tokens, dtype)
                    kw["ula_host_pool_gib"] = args.host_pool_gib
                    env[OPT_IN_ENV] = "1"
                else:
                    kw["kv_cache_memory_bytes"] = kv_bytes_for(stock_tokens, dtype)
                runs.append({"name": f"{dtype}/{graphs}/{backend}", "config": f"{dtype}/{graphs}",
                             "backend": backend, "engine_kwargs": kw, "env": env,
                             "workload": {"prompts": args.prompts, "prompt_tokens": [lo, hi],
                                          "max_tokens": args.max_tokens,
                                          "tpot_tokens": args.tpot_tokens,
                                          "concurrency": [int(c) for c in
                                                          _csv(args.concurrency)],
                                          "sweep_seconds": args.sweep_seconds}})
    return runs


def machine_problem() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return ("no CUDA device is visible (torch.cuda.is_available() is False): this check "
                "needs an NVIDIA GPU of compute capability 9.x or 10.x")
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return (f"compute capability {major}.x: vLLM's FlashMLA-sparse backend needs 9.x "
                f"(H100/H200) or 10.x (B200/B300)")
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed: pip install vllm==0.32.0 (the CUDA build)"
    if vllm.__version__.split("+")[0] != "0.32.0":
        return f"vLLM {vllm.__version__} is installed; this check is for vLLM 0.32.0"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "the installed vLLM is not a CUDA build (current_platform is not CUDA)"
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        return ("DeepGEMM is not installed: vLLM's DeepSeek-V3.2 indexer needs it on CUDA "
                "(see vLLM's DeepSeek-V3.2 recipe)")
    return None


# --------------------------------------------------------------- engine runs
def _prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    vocab = tok.vocab_size
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


def run_child(spec: dict, model: str) -> dict:
    """One engine: parity workload, batch-1 TPOT, concurrency sweep, ulacache counters."""
    from vllm import LLM, SamplingParams

    wl = spec["workload"]
    llm = LLM(model=model, **spec["engine_kwargs"])
    tok = llm.get_tokenizer()
    lo, hi = wl["prompt_tokens"]
    prompts = _prompts(tok, wl["prompts"], lo, hi)
    greedy = SamplingParams(temperature=0.0, max_tokens=wl["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    res = {"name": spec["name"], "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    one = SamplingParams(temperature=0.0, max_tokens=wl["tpot_tokens"], ignore_eos=True)
    short = _prompts(tok, 1, 128, 128, seed=1)[0]
    llm.generate([{"prompt_token_ids": short}], one)  # warm
    t0 = time.perf_counter()
    o = llm.generate([{"prompt_token_ids": short}], one)[0]
    res["tpot_s"] = (time.perf_counter() - t0) / max(1, len(o.outputs[0].token_ids))
    sweep = {}
    for c in wl["concurrency"]:
        batch = [{"prompt_token_ids": p} for p in _prompts(tok, c, 256, 512, seed=2 + c)]
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        n_tok, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < wl["sweep_seconds"]:
            n_tok += sum(len(x.outputs[0].token_ids) for x in llm.generate(batch, sp))
        sweep[str(c)] = n_tok / (time.perf_counter() - t0)
    res["sweep_tok_s"] = sweep
    if spec["backend"] == "ulacache":
        usage = llm.collective_rpc("ulacache_usage")[0]
        res["usage"] = usage.get("totals", {})
    return res


def run_spec(spec: dict, model: str, timeout: int) -> dict:
    env = dict(os.environ, **spec["env"])
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f.name,
               "--model-dir", model]
        proc = subprocess.run(cmd, input=json.dumps(spec), env=env, text=True,
                              capture_output=True, timeout=timeout)
        if proc.returncode != 0:
            return {"name": spec["name"], "error": (proc.stdout[-3000:] + proc.stderr[-3000:])}
        return json.load(open(f.name))


def compare(stock: dict, ula: dict) -> dict:
    out = {"config": ula["name"].rsplit("/", 1)[0]}
    if "error" in stock or "error" in ula:
        out["error"] = stock.get("error") or ula.get("error")
        out["pass"] = False
        return out
    same = [a == b for a, b in zip(stock["tokens"], ula["tokens"])]
    u = ula.get("usage", {})
    out.update(parity=all(same) and len(stock["tokens"]) == len(ula["tokens"]),
               prompts_equal=f"{sum(same)}/{len(same)}",
               promotions=u.get("promotions", 0), demotions=u.get("demotions", 0),
               staged=u.get("staged", 0), overflow=u.get("overflow", 0),
               chunked_calls=u.get("chunked_calls", 0),
               tpot_ratio=ula["tpot_s"] / stock["tpot_s"],
               sweep_ratio={c: ula["sweep_tok_s"][c] / stock["sweep_tok_s"][c]
                            for c in stock["sweep_tok_s"]})
    out["pass"] = bool(out["parity"] and out["promotions"] > 0 and out["demotions"] > 0
                       and out["overflow"] == 0)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(sys.stdin.read())
        res = run_child(spec, args.model_dir)
        Path(args.child).write_text(json.dumps(res))
        return 0
    plan = build_plan(args)
    if args.plan:
        print(json.dumps(plan, indent=2))
        return 0
    problem = machine_problem()
    if problem:
        print(f"cuda_e2e_check: cannot run here: {problem}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from ulacache_vllm.models import build_model

    model = args.model_dir or tempfile.mkdtemp(prefix="ula-cuda-tiny-")
    build_model("deepseek_v32", Path(model) / "deepseek_v32_cuda", overrides=CUDA_SHAPE)
    model = str(Path(model) / "deepseek_v32_cuda")
    results, rows = {}, []
    for spec in plan:
        print(f"== {spec['name']} ...", flush=True)
        results[spec["name"]] = run_spec(spec, model, args.timeout)
        if spec["backend"] == "ulacache":
            stock = results[spec["name"].replace("/ulacache", "/vllm")]
            rows.append(compare(stock, results[spec["name"]]))
    ok = True
    for r in rows:
        ok &= r["pass"]
        if "error" in r:
            print(f"{r['config']}: ERROR\n{r['error']}")
            continue
        sweep = ", ".join(f"c={c}: {v:.2f}x" for c, v in r["sweep_ratio"].items())
        print(f"{r['config']}: tokens: {'PASS' if r['parity'] else 'FAIL'} "
              f"({r['prompts_equal']} prompts equal); promotions {r['promotions']}, demotions "
              f"{r['demotions']}, staged {r['staged']}, overflow {r['overflow']}, token-chunked "
              f"layer calls {r['chunked_calls']}; batch-1 TPOT "
              f"ulacache/stock {r['tpot_ratio']:.2f}x; throughput ulacache/stock {sweep}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": rows}, indent=2))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
