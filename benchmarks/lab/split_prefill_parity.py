"""Lab probe: is a bf16 hybrid's greedy output a fixed reference, and does the arena match it?

Tiny Qwen3-Next (bf16, GDN state + full attention), 6 greedy requests at once, TP=P. Each
engine runs in its own subprocess, with a step budget that splits one prompt's prefill across
two steps ("split") and with one that takes every prompt whole ("whole"). Stock runs twice per
budget, the arena once (moves forced). Prints the first differing (request, token) of stock
against stock and of the arena against stock; exit 1 when the arena differs.

By default vLLM's engine core runs in the subprocess's own process, so every request is queued
before the first step; `--separate-core` keeps vLLM's default core process, whose first steps
take whichever requests have arrived (another batch: in bf16, another result).

    python benchmarks/lab/split_prefill_parity.py --tp 2 [--separate-core]

TP=P binds one core per rank (VLLM_CPU_OMP_THREADS_BIND). Findings:
benchmarks/results/arena_host_parity.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

MARK = "@@SPLIT_PREFILL@@"
ENGINE = r"""
import json, os, sys
from vllm import LLM, SamplingParams
a = json.loads(os.environ["SPLIT_PREFILL_ARGS"])
llm = LLM(model=a["model"], dtype="bfloat16", enforce_eager=True, max_model_len=1024,
          max_num_batched_tokens=a["budget"], enable_chunked_prefill=True,
          enable_prefix_caching=False, seed=0,
          max_num_seqs=6, tensor_parallel_size=a["tp"], **a["kw"])
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
         "omicron pi rho sigma tau upsilon").split()
prompts = [" ".join(words[(i * 7 + j * (i + 3)) % len(words)] for j in range(30 + 23 * i))
           for i in range(6)]
outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40 + 11 * i,
                                             ignore_eos=True) for i in range(6)])
cc = llm.llm_engine.vllm_config.cache_config
print(a["mark"] + json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "prompt_lens": [len(o.prompt_token_ids) for o in outs],
    "ssm_dtype": str(cc.mamba_ssm_cache_dtype)}))
"""


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, token) of the first differing token, by request order; None when equal."""
    for r, (x, y) in enumerate(zip(a, b)):
        for t, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return r, t
    return None


def run_engine(model: str, budget: int, tp: int, kw: dict, separate_core: bool) -> dict:
    env = {**os.environ, "SPLIT_PREFILL_ARGS": json.dumps(
        {"model": model, "budget": budget, "tp": tp, "kw": kw, "mark": MARK}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if not separate_core:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    out = subprocess.run([sys.executable, "-c", ENGINE], env=env, capture_output=True,
                         text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise RuntimeError(f"engine run failed (rc {out.returncode}):\n{out.stderr[-4000:]}")


def main(argv: list[str] | None = None) -> int:
    from _host import cpu_host
    from ulacache_vllm.models import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--separate-core", action="store_true",
                    help="run vLLM's engine core in its own process (vLLM's default): requests "
                         "then reach it while it steps, so the first steps' batches vary by run")
    ap.add_argument("--out", type=Path, help="write the runs and differences as JSON here")
    args = ap.parse_args(argv)

    path = REPO / "models_cache" / "lab_qwen3_next"
    if not (path / "config.json").exists():
        build_model("qwen3_next", path)
    arena = {"kv_backend": "ulacache", "kv_cache_memory_bytes": 16 << 20,
             "ula_arena_force_moves": 2}
    stock = {"kv_backend": "vllm", "kv_cache_memory_bytes": 128 << 20}
    report = {"host": cpu_host(), "tp": args.tp, "separate_core": args.separate_core,
              "budgets": {}}
    differs = False
    for name, budget in (("split", 1024), ("whole", 2048)):
        s0, s1 = (run_engine(str(path), budget, args.tp, stock, args.separate_core)
                  for _ in range(2))
        ula = run_engine(str(path), budget, args.tp, arena, args.separate_core)
        pairs = {"stock vs stock": first_difference(s0["tokens"], s1["tokens"]),
                 "arena vs stock": first_difference(ula["tokens"], s0["tokens"])}
        differs |= pairs["arena vs stock"] is not None
        report["budgets"][name] = {"budget": budget, "prompt_lens": s0["prompt_lens"],
                                   "ssm_dtype": s0["ssm_dtype"], "first_difference": pairs}
        print(f"{name:5s} (max_num_batched_tokens {budget}, prompts {s0['prompt_lens']}, "
              f"SSM state {s0['ssm_dtype']}):")
        for k, v in pairs.items():
            print(f"  {k}: " + ("token-exact" if v is None
                                 else f"request {v[0]} differs at token {v[1]}"))
    print("host:", report["host"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
