"""Accuracy consistency: ulacache vs stock vLLM through lm-eval's `vllm` model.

Runs the same lm-eval task twice, `kv_backend=vllm` and `kv_backend=ulacache` (with memory
pressure so the host tier is used), and reports both scores plus whether every generation was
token-identical (greedy). Tasks:

- `gsm8k` (lm-eval's own task) when the GSM8K data is available to `datasets` offline;
- `ulacache_arith` otherwise: a GSM8K-format task over self-written word problems in
  `evals/fixtures/` (same prompt/answer/filter shape as GSM8K).

    python evals/consistency.py --model MODEL --limit 8 \
        --ula-args ula_host_pool_gib=0.01,kv_cache_memory_bytes=13500000

Exit code 0 only when scores match and generations are token-identical.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "arith_word_problems.jsonl"

ARITH_TASK = """\
task: ulacache_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: ["\\n\\n", "Question:"]
  do_sample: false
  max_gen_toks: {max_gen}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
metadata:
  version: 1.0
"""


def write_task(dirpath: Path, max_gen: int) -> str:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "ulacache_arith.yaml").write_text(ARITH_TASK.format(data=FIXTURE, max_gen=max_gen))
    return str(dirpath)


def gsm8k_available() -> bool:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets

        datasets.load_dataset("gsm8k", "main", split="test[:1]")
        return True
    except Exception:
        return False


def run_lm_eval(model: str, backend: str, extra: str, task: str, include: str, limit: int,
                out: Path, dtype: str, num_fewshot: int) -> dict:
    args = f"pretrained={model},kv_backend={backend},dtype={dtype},enforce_eager=True,max_model_len=1024,seed=0"
    if extra:
        args += "," + extra
    cmd = [sys.executable, "-m", "lm_eval", "--model", "vllm", "--model_args", args,
           "--tasks", task, "--include_path", include, "--limit", str(limit),
           "--output_path", str(out), "--log_samples", "--batch_size", "auto",
           "--num_fewshot", str(num_fewshot)]
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval ({backend}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    results = sorted(out.rglob("results_*.json"))[-1]
    samples = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1]
    res = json.loads(results.read_text())["results"][task]
    gens = [json.loads(l)["resps"] for l in samples.read_text().splitlines() if l.strip()]
    docs = [json.loads(l)["doc_id"] for l in samples.read_text().splitlines() if l.strip()]
    return {"scores": {k: v for k, v in res.items() if isinstance(v, (int, float))},
            "generations": dict(zip(docs, gens))}


def compare(model: str, *, limit: int = 8, ula_args: str = "", ref_args: str = "",
            task: str | None = None, dtype: str = "float32", max_gen: int = 48,
            num_fewshot: int = 4) -> dict:
    with tempfile.TemporaryDirectory(prefix="ulacache_evals_") as td:
        td = Path(td)
        include = write_task(td / "tasks", max_gen)
        task = task or ("gsm8k" if gsm8k_available() else "ulacache_arith")
        ref = run_lm_eval(model, "vllm", ref_args, task, include, limit, td / "ref", dtype,
                          num_fewshot)
        ula = run_lm_eval(model, "ulacache", ula_args, task, include, limit, td / "ula", dtype,
                          num_fewshot)
    same = ref["generations"] == ula["generations"]
    return {"task": task, "limit": limit, "stock": ref["scores"], "ulacache": ula["scores"],
            "scores_equal": ref["scores"] == ula["scores"], "generations_identical": same,
            "num_docs": len(ref["generations"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--task", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-fewshot", type=int, default=4)
    ap.add_argument("--ula-args", default="", help="extra model_args for the ulacache run")
    ap.add_argument("--ref-args", default="", help="extra model_args for the stock run")
    a = ap.parse_args()
    rep = compare(a.model, limit=a.limit, ula_args=a.ula_args, ref_args=a.ref_args,
                  task=a.task, dtype=a.dtype, num_fewshot=a.num_fewshot)
    print(json.dumps(rep, indent=2))
    return 0 if rep["scores_equal"] and rep["generations_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
