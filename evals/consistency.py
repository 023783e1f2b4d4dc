"""Accuracy consistency: ulacache vs stock vLLM through lm-eval's `vllm` model.

Runs the same lm-eval task twice, `kv_backend=vllm` and `kv_backend=ulacache`, and reports both
scores, whether every greedy generation was identical, and the ulacache run's tier counters
(`host_tier_used`: rows were demoted to the host pool and promoted back, so the comparison
covered the tiered path, not only the all-on-device fast path; that takes a KV budget below
what the documents need at once, as in the example). Tasks:

- `gsm8k` (lm-eval's own task) when the GSM8K data is available to `datasets` offline;
- `ulacache_arith` otherwise: a GSM8K-format task over self-written word problems in
  `evals/fixtures/` (same prompt/answer/filter shape as GSM8K).
- `--task lexsum`: long-document summarization scored with ROUGE-1/2/L: `multi_lexsum` (the
  real Multi-LexSum, several long case documents per summary) when its data is available
  offline, else `ulacache_lexsum` over self-written cases of the same shape (~800-token
  sources; `evals/fixtures/make_lexsum_cases.py`). Zero-shot (`--num-fewshot 0`). Real cases
  run to tens of thousands of tokens: give both runs a `max_model_len=...` model arg that
  fits them (lm-eval keeps the last `max_model_len - max_gen` tokens of a longer prompt).
- any other lm-eval task name is passed through.

    python evals/consistency.py --model MODEL --limit 8 --require-host-tier \
        --ula-args ula_host_pool_gib=0.006,kv_cache_memory_bytes=10500000 \
        --ref-args kv_cache_memory_bytes=268435456

(the tiny default model: 8 four-shot prompts of ~340 tokens outgrow its ~2k device slots.
On vLLM's CPU build a run without `kv_cache_memory_bytes` sizes its KV cache from free RAM
and fails when less than ~92 % of the machine's memory is free.)

Exit code 0 only when scores match and generations are identical (and, with
`--require-host-tier`, the host tier was used).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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


LEXSUM_COMMON = """\
output_type: generate_until
doc_to_text: !function lexsum_task.doc_to_text
doc_to_target: !function lexsum_task.doc_to_target
process_results: !function lexsum_task.process_results
generation_kwargs:
  until: ["\\n\\n"]
  do_sample: false
  max_gen_toks: {max_gen}
metric_list:
  - metric: rouge1
    aggregation: mean
    higher_is_better: true
  - metric: rouge2
    aggregation: mean
    higher_is_better: true
  - metric: rougeL
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
# The real data (long federal civil-rights case documents) when available offline.
MULTI_LEXSUM_TASK = """\
task: multi_lexsum
dataset_path: allenai/multi_lexsum
dataset_name: v20230518
test_split: test
""" + LEXSUM_COMMON
LEXSUM_TASK = """\
task: ulacache_lexsum
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
""" + LEXSUM_COMMON
LEXSUM_FIXTURE = HERE / "fixtures" / "lexsum_cases.jsonl"


def write_task(dirpath: Path, max_gen: int) -> str:
    """Write the task yamls (and the summarization task's functions) into ``dirpath``, an
    lm-eval ``--include_path``."""
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "ulacache_arith.yaml").write_text(ARITH_TASK.format(data=FIXTURE, max_gen=max_gen))
    (dirpath / "ulacache_lexsum.yaml").write_text(
        LEXSUM_TASK.format(data=LEXSUM_FIXTURE, max_gen=max_gen))
    (dirpath / "multi_lexsum.yaml").write_text(MULTI_LEXSUM_TASK.format(max_gen=max_gen))
    shutil.copy(HERE / "lexsum_task.py", dirpath / "lexsum_task.py")
    return str(dirpath)


def dataset_available(path: str, name: str) -> bool:
    """Whether ``datasets`` can load this dataset offline (cached); no download is tried."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets

        datasets.load_dataset(path, name, split="test[:1]")
        return True
    except Exception:
        return False


# --task aliases: the real dataset's lm-eval task when its data is cached, else our fixture task.
TASKS = {"gsm8k": (("gsm8k", "main"), "gsm8k", "ulacache_arith"),
         "lexsum": (("allenai/multi_lexsum", "v20230518"), "multi_lexsum", "ulacache_lexsum")}


FEWSHOT = {"gsm8k": 4, "ulacache_arith": 4, "multi_lexsum": 0, "ulacache_lexsum": 0}


def resolve_task(task: str | None) -> str:
    task = task or "gsm8k"
    if task not in TASKS:
        return task
    real, name, fixture = TASKS[task]
    return name if dataset_available(*real) else fixture


def run_lm_eval(model: str, backend: str, extra: str, tasks: list[dict], include: str,
                out: Path, dtype: str, env_extra: dict[str, str] | None = None) -> list[dict]:
    """One lm-eval process of lm-eval's ``vllm`` model: the child builds the model from the
    same ``--model_args`` string the ``lm_eval`` CLI would get and evaluates each of ``tasks``
    (``{"task", "limit", "num_fewshot"}``) in turn on that one engine; for ulacache it reads
    the tier counters off the engine around each task, so each task's report can show the host
    tier was really used by that task. ``env_extra`` is added to the child's environment (e.g.
    the CPUs its engine binds to). Returns one result per task."""
    args = f"pretrained={model},kv_backend={backend},dtype={dtype},enforce_eager=True,max_model_len=1024,seed=0"
    if extra:
        args += "," + extra
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(model_args=args, tasks=tasks, include=include, result=str(out / "result.json"))
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, __file__, "--worker", str(out / "spec.json")],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval ({backend}) failed: {root_cause(proc.stderr)}\n"
                           f"--- stdout tail:\n{proc.stdout[-2000:]}\n--- stderr tail:\n{proc.stderr[-4000:]}")
    return json.loads((out / "result.json").read_text())


_GENERIC = ("Engine core initialization failed", "See root cause above")


def root_cause(stderr: str) -> str:
    """The last specific exception line of a child's stderr: vLLM's engine-core failures end
    in a generic "See root cause above", which a tail of the log cuts off."""
    found = "(no exception line in stderr)"
    for line in stderr.splitlines():
        head = line.strip().split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head and not any(
                g in line for g in _GENERIC):
            found = line.strip()
    return found


def _worker(spec_path: str) -> int:
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    spec = json.loads(Path(spec_path).read_text())
    lm = get_model("vllm").create_from_arg_string(spec["model_args"], {"batch_size": "auto"})
    ula = "kv_backend=ulacache" in spec["model_args"]
    keys = ("lookups", "hits", "promotions", "demotions")

    def tiers():
        usage = lm.model.collective_rpc("ulacache_usage")
        return {k: sum(u["totals"][k] for u in usage) for k in keys}

    results = []
    manager = TaskManager(include_path=spec["include"])
    for t in spec["tasks"]:
        before = tiers() if ula else None
        res = lm_eval.simple_evaluate(model=lm, tasks=[t["task"]], num_fewshot=t["num_fewshot"],
                                      limit=t["limit"], log_samples=True, task_manager=manager)
        task = t["task"]
        samples = res["samples"][task]
        out = {"scores": {k: v for k, v in res["results"][task].items()
                          if isinstance(v, (int, float))},
               "generations": {str(s["doc_id"]): s["resps"] for s in samples}, "tiers": None}
        if ula:  # this task's own tier moves
            after = tiers()
            out["tiers"] = {k: after[k] - before[k] for k in keys}
        results.append(out)
    Path(spec["result"]).write_text(json.dumps(results, default=str))
    return 0


def _nonempty(resps) -> bool:
    """lm-eval's ``resps`` of one doc (lists of strings) hold some non-blank text."""
    if isinstance(resps, str):
        return bool(resps.strip())
    return any(_nonempty(r) for r in resps)


def compare_tasks(model: str, tasks: list[dict], *, ula_args: str = "", ref_args: str = "",
                  dtype: str = "float32", max_gen: int = 48,
                  side_by_side: list[dict[str, str]] | None = None) -> list[dict]:
    """Compare several tasks (``{"task", "limit", "num_fewshot"}``; ``task`` and
    ``num_fewshot`` as ``compare`` takes them) with one engine per backend: each lm-eval
    process evaluates every task in turn. Without ``side_by_side`` the stock process runs, then
    the ulacache one (each engine gets the machine to itself); with it (two environment
    additions, stock's then ulacache's: e.g. disjoint CPUs for their engines) both run at once.
    Returns one report per task, as ``compare``'s."""
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(prefix="ulacache_evals_") as td:
        td = Path(td)
        include = write_task(td / "tasks", max_gen)
        specs = []
        for t in tasks:
            task = resolve_task(t.get("task"))
            num_fewshot = t.get("num_fewshot")
            if num_fewshot is None:  # other tasks: their own yaml default
                num_fewshot = FEWSHOT.get(task)
            specs.append({"task": task, "limit": t.get("limit", 8), "num_fewshot": num_fewshot})
        runs = [("vllm", ref_args, td / "ref"), ("ulacache", ula_args, td / "ula")]
        if side_by_side is None:
            ref, ula = (run_lm_eval(model, b, a, specs, include, d, dtype) for b, a, d in runs)
        else:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="lm_eval") as pool:
                futures = [pool.submit(run_lm_eval, model, b, a, specs, include, d, dtype, e)
                           for (b, a, d), e in zip(runs, side_by_side)]
                ref, ula = (f.result() for f in futures)
    return [_report(spec, r, u) for spec, r, u in zip(specs, ref, ula)]


def _report(spec: dict, ref: dict, ula: dict) -> dict:
    same = ref["generations"] == ula["generations"]
    tiers = ula["tiers"]
    return {"task": spec["task"], "limit": spec["limit"], "num_fewshot": spec["num_fewshot"],
            "stock": ref["scores"], "ulacache": ula["scores"],
            "scores_equal": ref["scores"] == ula["scores"], "generations_identical": same,
            "num_docs": len(ref["generations"]),
            "nonempty_generations": sum(map(_nonempty, ula["generations"].values())),
            "ulacache_tiers": tiers,
            # Rows went to the host and came back: the comparison covered the tiered path,
            # not only the all-on-device fast path.
            "host_tier_used": bool(tiers and tiers["demotions"] > 0 and tiers["promotions"] > 0)}


def compare(model: str, *, limit: int = 8, ula_args: str = "", ref_args: str = "",
            task: str | None = None, dtype: str = "float32", max_gen: int = 48,
            num_fewshot: int | None = None) -> dict:
    (rep,) = compare_tasks(model, [{"task": task, "limit": limit, "num_fewshot": num_fewshot}],
                           ula_args=ula_args, ref_args=ref_args, dtype=dtype, max_gen=max_gen)
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--task", default=None,
                    help="gsm8k (default), lexsum, or any lm-eval task name")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-fewshot", type=int, default=None,
                    help="default: 4 for the GSM8K tasks, 0 for the summarization ones")
    ap.add_argument("--ula-args", default="", help="extra model_args for the ulacache run")
    ap.add_argument("--ref-args", default="", help="extra model_args for the stock run")
    ap.add_argument("--require-host-tier", action="store_true",
                    help="also fail unless the ulacache run demoted and promoted rows")
    a = ap.parse_args()
    rep = compare(a.model, limit=a.limit, ula_args=a.ula_args, ref_args=a.ref_args,
                  task=a.task, dtype=a.dtype, num_fewshot=a.num_fewshot)
    print(json.dumps(rep, indent=2))
    if not rep["host_tier_used"]:
        print("note: the ulacache run kept every row on the device (no demotions); give it a "
              "smaller kv_cache_memory_bytes or more documents to compare the tiered path",
              file=sys.stderr)
    ok = rep["scores_equal"] and rep["generations_identical"]
    return 0 if ok and (rep["host_tier_used"] or not a.require_host_tier) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2]))
    sys.exit(main())
