"""Lab check: a failed CSA row copy in a running DeepSeek-V4 engine under ``--kv-backend
ulacache`` ends only the requests holding the rows it lost.

The tiny V4 (``python -m ulacache_vllm.models build deepseek_v4``), the v4 line with few CSA
device rows (the long prompts' rows are demoted to the host pool, decodes promote some back),
the engine core in this process. A batch (long prompts past 4 x 512 tokens, so the real indexer
selects rows, and short ones) runs greedily without faults: the reference (the v4 line's
parity with stock V4 is ``tests/test_v4_line.py``). Then the same batch with one demotion
copy failing (``ULACACHE_TEST_MOVE_FAULTS``, ``engine/faults.py``), then with one promotion
failing: the requests that end with finish_reason "error" are exactly those whose CSA blocks
(read from the scheduler's block tables when the lost blocks are reported) the failed copy
lost, their tokens a prefix of their reference; every other request gets its reference
tokens; one failed copy is counted; the batch sent again gets its reference tokens; at the
end both CSA tiers are empty. Prints one JSON line and exits 1
if any of that fails.

    python benchmarks/lab/v4_faults.py [--model DIR]
    python benchmarks/lab/v4_ops/run.py benchmarks/lab/v4_faults.py   # hosts without AVX512-BF16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _model(arg: str | None) -> str:
    if arg:
        return arg
    sys.path.insert(0, str(REPO))
    from ulacache_vllm.models import build_model

    out = REPO / "models_cache" / "lab-deepseek-v4"
    if not (out / "config.json").exists():
        build_model("deepseek_v4", out, seed=0)
    return str(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--csa-device-rows", type=int, default=900)
    ap.add_argument("--out", type=int, default=24)
    args = ap.parse_args()
    model = _model(args.model)
    faults = Path(tempfile.mkdtemp(prefix="ulacache_v4_faults_")) / "faults.json"
    faults.write_text("")
    os.environ["ULACACHE_TEST_MOVE_FAULTS"] = str(faults)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=3072,
              max_num_batched_tokens=3072, max_num_seqs=6, seed=0, enable_prefix_caching=False,
              kv_backend="ulacache", kv_cache_memory_bytes=96 << 20,
              ula_v4_csa_device_rows=args.csa_device_rows, disable_log_stats=False)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (2300, 2150, 2200, 300, 90)]
    greedy = SamplingParams(temperature=0, max_tokens=args.out, ignore_eos=True)

    def gen(ps):
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]

    def arm(**spec):
        faults.write_text(json.dumps({**spec, "nonce": time.time()}) if spec else "")

    def usage():
        return llm.collective_rpc("ulacache_usage")[0]["csa"]

    def metric(name):
        return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

    # Who held the lost rows, computed here from the scheduler's own block tables at the moment
    # the lost blocks are reported (before the manager acts on them), against whom it ended.
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    kvm = sched.kv_cache_manager
    index = {tuple(p): i for i, p in enumerate(prompts)}
    seen: list[dict] = []
    lost_block_owners = kvm.lost_block_owners

    def recording(block_ids, requests, *a, **k):
        requests = list(requests)
        lost = {-1 - b for b in block_ids if b < 0}
        g = kvm.layout.csa.group
        holders = {index[tuple(r.prompt_token_ids)] for r in sched.requests.values()
                   if lost.intersection(kvm.get_block_ids(r.request_id)[g])}
        owners = lost_block_owners(block_ids, requests, *a, **k)
        ended = {index[tuple(sched.requests[rid].prompt_token_ids)] for rid in owners}
        seen.append({"lost_csa_blocks": len(lost), "holders": sorted(holders),
                     "ended": sorted(ended)})
        return owners

    kvm.lost_block_owners = recording
    want = [t for t, _ in gen(prompts)]
    res: dict = {"moved": usage()}
    problems = []
    for move in ("demote", "promote"):
        before = metric("vllm:ulacache_v4_csa_failed_copies")
        seen.clear()
        arm(fault="raise", moves=[move], skip=0, count=1)
        got = gen(prompts)
        arm()
        failed = [i for i, (_, why) in enumerate(got) if why == "error"]
        for i, (tokens, why) in enumerate(got):
            if i in failed and tokens != want[i][:len(tokens)]:
                problems.append(f"{move}: request {i} ended with tokens off its reference")
            if i not in failed and (why != "length" or tokens != want[i]):
                problems.append(f"{move}: request {i} ({why}) differs from its reference")
        if not failed:
            problems.append(f"{move}: no request ended (the copy failure must end its holders)")
        if not seen or not all(e["lost_csa_blocks"] > 0 for e in seen):
            problems.append(f"{move}: no lost CSA block reported: {seen}")
        holders = sorted({i for e in seen for i in e["holders"]})
        if holders != failed or any(e["holders"] != e["ended"] for e in seen):
            problems.append(f"{move}: ended {failed}, held lost rows {holders}: {seen}")
        copies = metric("vllm:ulacache_v4_csa_failed_copies") - before
        if copies != 1:
            problems.append(f"{move}: {copies} failed copies counted, 1 injected")
        # The whole batch again (the same schedule as the reference's: stock V4 on CPU is not
        # schedule-invariant, so a prompt alone could differ from its batched tokens).
        if [t for t, _ in gen(prompts)] != want:
            problems.append(f"{move}: the batch, sent again, differs from the reference")
        res[move] = {"failed": failed, "reports": list(seen), "failed_copies": copies}
    llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=1))
    llm.llm_engine.step()  # the empty step that carries the last frees to the worker
    res["end"] = end = usage()
    if end["device_used"] or end["host_used"]:
        problems.append(f"rows left in the CSA tiers: {end['device_used']} / {end['host_used']}")
    if not (res["moved"]["demotions"] > 0 and res["moved"]["promotions"] > 0):
        problems.append("no demotion or promotion in the reference batch: raise the pressure")
    res["problems"] = problems
    print(json.dumps(res))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
