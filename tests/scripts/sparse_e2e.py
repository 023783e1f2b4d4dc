"""One vLLM engine, several checks of the CPU sparse-MLA path; prints one JSON line.

Run by tests/test_sparse_backend.py in a subprocess (one engine per model):

    python tests/scripts/sparse_e2e.py --model DIR --spec SPEC_JSON

SPEC_JSON: {"prompts": [[ids...], ...], "max_tokens": int, "num_logprobs": int,
            "batch_checks": bool, "llm_kwargs": {...}}

"llm_kwargs" are added to the engine's keywords: the caller pins what its comparisons depend
on (the MLA path's schedule, and for the dense-MLA twin vLLM's reference CPU_MLA kernel, which
takes float32 on every host), so that the engine does not follow the host's defaults.

Emits (after the marker line prefix) a JSON object with
- "prompt_lp": per prompt, per position >= 1: [logprob of the actual token, {id: logprob} top-n]
- "gen": per prompt, per generated step: [token id, {id: logprob} top-n] (greedy)
- "batched": [[tokens per prompt] run 1, run 2] (greedy, all prompts in one generate call)
- "single": [tokens per prompt] (greedy, each prompt alone)
- "config": the schedule and cache choices the engine resolved (block size, chunked prefill,
  prefix caching, max_num_batched_tokens) and the attention backend asked for
- "select": statistics of what the DSA indexer selected and attention consumed (DSA models):
  computed in this process (the engine runs in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) by
  wrapping `cpu_indexer.select_topk` and the `sparse_mla_attention` used by the backend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

MARK = "@@SPARSE_E2E@@"


class SelectStats:
    """Checks every indexer selection in flight; counts, never raises (the test asserts)."""

    def __init__(self):
        self.topk_calls = 0
        self.rows = 0
        self.rows_full_prefix = 0  # prefix <= k: every causal position selected, rest -1
        self.rows_sparse = 0  # prefix > k: k distinct positions, no -1
        self.bad_rows = 0  # anything else (duplicates, non-causal, wrong count / padding)
        self.max_prefix = 0
        self.topk = None
        self.attn_calls = 0
        self.attn_rows = 0
        self.attn_max_valid = 0
        self.attn_rows_with_k_valid = 0
        self.attn_dup_rows = 0
        self.attn_width = None

    def on_select(self, positions, topk, out):
        self.topk_calls += 1
        self.topk = topk
        for p, row in zip(positions.tolist(), out.tolist()):
            prefix = p + 1
            self.rows += 1
            self.max_prefix = max(self.max_prefix, prefix)
            valid = [x for x in row if x >= 0]
            pad_ok = all(x == -1 for x in row[len(valid):])  # -1 only at the end
            causal = all(x < prefix for x in valid)
            distinct = len(set(valid)) == len(valid)
            if not (pad_ok and causal and distinct):
                self.bad_rows += 1
            elif prefix <= topk and sorted(valid) == list(range(prefix)):
                self.rows_full_prefix += 1
            elif prefix > topk and len(valid) == topk:
                self.rows_sparse += 1
            else:
                self.bad_rows += 1

    def on_attn(self, rows):
        self.attn_calls += 1
        self.attn_width = int(rows.shape[1])
        for row in rows.tolist():
            valid = [x for x in row if x >= 0]
            self.attn_rows += 1
            self.attn_max_valid = max(self.attn_max_valid, len(valid))
            if self.topk is not None and len(valid) == self.topk:
                self.attn_rows_with_k_valid += 1
            if len(set(valid)) != len(valid):
                self.attn_dup_rows += 1


def install_hooks(stats: SelectStats) -> None:
    from ulacache_vllm.engine.dsa import cpu_indexer, cpu_sparse_mla

    orig_select = cpu_indexer.select_topk
    orig_attn = cpu_sparse_mla.sparse_mla_attention

    def select_topk(q, weights, keys, positions, topk):
        out = orig_select(q, weights, keys, positions, topk)
        stats.on_select(positions, topk, out)
        return out

    def sparse_mla_attention(q, kv_rows, rows, scale, d_v, **staged):
        stats.on_attn(rows)
        return orig_attn(q, kv_rows, rows, scale, d_v, **staged)

    cpu_indexer.select_topk = select_topk
    cpu_sparse_mla.sparse_mla_attention = sparse_mla_attention


def _lp_dict(d):
    return {str(k): float(v.logprob) for k, v in d.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--spec", required=True)
    a = ap.parse_args()
    spec = json.loads(a.spec)

    import time

    t0 = time.perf_counter()
    timings = {}
    from vllm import LLM, SamplingParams

    stats = SelectStats()
    install_hooks(stats)

    llm = LLM(
        model=a.model,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=1024,
        max_num_seqs=8,
        seed=0,
        **spec.get("llm_kwargs", {}),
    )
    timings["engine_ready"] = time.perf_counter() - t0
    c = llm.llm_engine.vllm_config
    sc, cc = c.scheduler_config, c.cache_config
    config = dict(block=cc.block_size, chunked=sc.enable_chunked_prefill,
                  prefix=cc.enable_prefix_caching, batched=sc.max_num_batched_tokens,
                  backend=str(c.attention_config.backend))
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    n = spec["num_logprobs"]
    res: dict = {}

    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                        prompt_logprobs=n, logprobs=n)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res["prompt_lp"] = []
    res["gen"] = []
    for ids, o in zip(spec["prompts"], outs):
        plp = []
        for pos in range(1, len(ids)):
            d = o.prompt_logprobs[pos]
            plp.append([float(d[ids[pos]].logprob), _lp_dict(d)])
        res["prompt_lp"].append(plp)
        c = o.outputs[0]
        res["gen"].append([[int(t), _lp_dict(d)] for t, d in zip(c.token_ids, c.logprobs)])

    timings["logprobs"] = time.perf_counter() - t0
    if spec.get("batch_checks"):
        greedy = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
        res["batched"] = []
        for _ in range(2):
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            res["batched"].append([list(map(int, o.outputs[0].token_ids)) for o in outs])
        res["single"] = []
        for p in prompts:
            (o,) = llm.generate([p], greedy, use_tqdm=False)
            res["single"].append(list(map(int, o.outputs[0].token_ids)))

    timings["total"] = time.perf_counter() - t0
    res["timings"] = timings
    res["config"] = config
    res["select"] = vars(stats)
    sys.stdout.write("\n" + MARK + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    main()
