"""Lab probe: random model shapes, prompts, lengths and budgets, stock against ulacache.

Each case (one seed) draws a served family (DeepSeek-V3.2 / GLM DSA through the logical address
space; Gemma 3, GPT-OSS, Qwen3-Next through the arena), a shape (layers, top-k, heads, window),
max_model_len, 3-9 prompts of random token ids (some sharing a prefix with an earlier one), a
max_tokens per request, prefix caching on or off, and a ulacache budget that is a fraction of the
workload's bytes (DSA: a device pool just above one step's rows and a host pool of that fraction;
arena: the arena). Stock gets room. Both engines run at the same time, each engine core in its
script's process with one pinned OpenMP share of the CPUs (as the suite's side-by-side pairs);
at ``--tp 2`` both engines' rank r share CPU share r (their workers are processes of their own).
The batch is generated twice when drawn (the second time in reverse order: prefix-cache hits on
rows the first pass left in either tier). Qwen3-Next runs bf16 (not batch-invariant on the CPU
build): its arena gets room and forced moves instead of pressure, so both run the same schedule.

A case is one of: token-exact, a startup refusal (the message is printed: it must name the sizes
and the fix), a mismatch, a leak (prefix caching off and something left in the pools at the
end), a crash (the last three exit 1), or "stock fails" (stock vLLM itself crashed or refused:
no reference; what ulacache did is recorded). The pressure counters each ulacache run
reached are kept (demotions, promotions, compactions, preemptions, prefix hits).

    python benchmarks/lab/parity_fuzz.py --seeds 0-39 [--tp 2] [--spec] [--out FILE.json]

Results: benchmarks/results/parity_fuzz.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from _host import cpu_host  # noqa: E402

MARK = "@@PARITY_FUZZ@@"
ENGINE = r"""
import json, os, sys
from vllm import LLM, SamplingParams
a = json.loads(os.environ["PARITY_FUZZ_ARGS"])
try:
    llm = LLM(model=a["model"], dtype=a["dtype"], enforce_eager=True, max_model_len=a["mml"],
              seed=0, disable_log_stats=False, **a["kw"])
except Exception as e:
    print(a["mark"] + json.dumps({"boot_error": f"{type(e).__name__}: {e}"[:2000]}))
    sys.exit(0)
prompts = [{"prompt_token_ids": p} for p in a["prompts"]]
sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in a["max_tokens"]]
if a.get("events"):  # arrivals and aborts by engine step (see add_aborts)
    eng, out, step, added = llm.llm_engine, [[] for _ in prompts], 0, set()
    aborted, ev = set(), a["events"]
    while len(added) < len(prompts) or eng.has_unfinished_requests():
        for i, e in enumerate(ev):
            if i not in added and e["arrive"] <= step:
                eng.add_request(str(i), prompts[i], sps[i])
                added.add(i)
        for o in eng.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)
        cut = [i for i, e in enumerate(ev) if i in added and i not in aborted and (
            (e["abort_tokens"] is not None and len(out[i]) >= e["abort_tokens"])
            or (e["abort_step"] is not None and step >= e["abort_step"]))]
        if cut:
            eng.abort_request([str(i) for i in cut])
            aborted.update(cut)
        step += 1
        assert step < 20000, "the engine stopped making progress"
    res = {"out": out, "aborted": sorted(aborted), "steps": step}
else:
    res = {"out": [list(o.outputs[0].token_ids)
                   for o in llm.generate(prompts, sps, use_tqdm=False)]}
if a["second"]:
    outs = llm.generate(prompts[::-1], sps[::-1], use_tqdm=False)
    res["out2"] = [list(o.outputs[0].token_ids) for o in outs][::-1]
llm.llm_engine.step()  # (in-process core) the empty step that ships the last frees
if a.get("events") and a["kw"].get("enable_prefix_caching"):
    res["reset"] = llm.reset_prefix_cache()  # then nothing may be left in the pools
    llm.llm_engine.step()  # (the step that ships the reset's frees to the worker)
res["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                  if m.name.startswith("vllm:ulacache_")
                  or m.name in ("vllm:num_preemptions", "vllm:prefix_cache_hits",
                                "vllm:spec_decode_num_draft_tokens",
                                "vllm:spec_decode_num_accepted_tokens")}
if a["kw"]["kv_backend"] == "ulacache":
    res["usage"] = llm.collective_rpc("ulacache_usage")  # one per rank
print(a["mark"] + json.dumps(res))
"""

DSA = ("deepseek_v32", "glm_dsa")
# Full-attention KV heads of the arena families (their head_dim is 64 in every tiny shape).
KV_HEADS = {"gemma3": 1, "gpt_oss": 2, "qwen3_next": 2}
# CPU sparse-MLA row: 576 fp32 values; the indexer key with its scale (rounded up).
MLA_ROW, INDEX_ROW = 576 * 4, 140


def draw(seed: int, tp: int = 1) -> dict:
    """One case from its seed (the same seed and ``tp`` draw the same case). At TP=2: the DSA
    families (ulacache in its default TP shard mode) and GPT-OSS (its two KV heads split)."""
    rng = random.Random(seed)
    fam = rng.choice(["deepseek_v32", "glm_dsa", "gemma3", "gpt_oss", "deepseek_v32", "gemma3",
                      "gpt_oss", "qwen3_next"] if tp == 1 else
                     ["deepseek_v32", "glm_dsa", "gpt_oss"])
    dtype = "float32"
    if fam in DSA:
        heads = rng.choice([2, 4, 8])
        shape = dict(num_hidden_layers=rng.choice([1, 2, 3]),
                     index_topk=rng.choice([8, 16, 32, 64]), num_attention_heads=heads,
                     num_key_value_heads=heads, first_k_dense_replace=rng.choice([0, 1]))
    elif fam == "gemma3":
        shape = dict(num_hidden_layers=rng.choice([2, 3, 6, 7]),
                     sliding_window=rng.choice([32, 64, 128, 200]), initializer_range=0.1,
                     tie_word_embeddings=False)
    elif fam == "gpt_oss":
        shape = dict(num_hidden_layers=rng.choice([2, 4, 6]),
                     sliding_window=rng.choice([32, 64, 128]), initializer_range=0.1)
    else:
        dtype, shape = "bfloat16", dict(num_hidden_layers=rng.choice([4, 8]))
    mml = rng.choice([512, 1024, 1536])
    prompts: list[list[int]] = []
    for _ in range(rng.randint(3, 9)):
        n = rng.randint(8, mml - 60)
        if prompts and rng.random() < 0.4:  # a prefix of an earlier prompt, then its own tail
            base = rng.choice(prompts)
            k = rng.randint(1, len(base))
            p = (base[:k] + [rng.randrange(1, 1000) for _ in range(max(0, n - k))])[:mml - 60]
        else:
            p = [rng.randrange(1, 1000) for _ in range(n)]
        prompts.append(p)
    return dict(seed=seed, tp=tp, family=fam, shape=shape, dtype=dtype, max_model_len=mml,
                prompts=prompts, max_tokens=[rng.randint(4, 48) for _ in prompts],
                prefix_caching=rng.random() < 0.5, fraction=rng.choice([0.1, 0.15, 0.25, 0.4]),
                second=rng.random() < 0.5, force_moves=rng.choice([0, 0, 2, 3]))


def add_speculation(c: dict) -> dict:
    """``c`` with speculative decoding on both engines, drawn from a second RNG of its seed (the
    case's other draws stay as without): DSA, an MTP layer built to agree with its target
    (``mtp_block_scale``), one draft token; Qwen3-Next, an MTP layer and two; Gemma 3 and
    GPT-OSS, n-gram drafts of 1-3 tokens. Half the prompts become a short motif repeated, on
    which drafts get accepted (the random targets repeat themselves often)."""
    rng = random.Random(1_000_003 * c["seed"] + 17)
    c = dict(c, shape=dict(c["shape"]))
    if c["family"] in DSA:
        c["shape"].update(num_nextn_predict_layers=1, mtp_block_scale=0.1)
        c["spec"] = {"method": "mtp", "num_speculative_tokens": 1}
    elif c["family"] == "qwen3_next":
        c["shape"].update(num_nextn_predict_layers=1, initializer_range=0.004)
        c["spec"] = {"method": "mtp", "num_speculative_tokens": 2}
    else:
        c["spec"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 2, 3]),
                     "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = []
    for p in c["prompts"]:
        if rng.random() < 0.5:
            motif = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 4))]
            p = (motif * (len(p) // len(motif) + 1))[:len(p)]
        prompts.append(p)
    c["prompts"] = prompts
    return c


def add_aborts(c: dict) -> dict:
    """``c`` driven step by step (``LLMEngine.add_request`` / ``step`` / ``abort_request``), drawn
    from a third RNG of its seed: each request arrives at step 0 or a later step, and is run to
    the end, aborted once it has a drawn number of output tokens, or aborted at a drawn step
    (waiting, in its prefill, preempted or decoding: wherever the schedule has it). The prompts
    are then generated again in full (prefix-cache hits on what the aborted requests left), and
    with prefix caching ``reset_prefix_cache()`` ends the run: nothing may be left in the pools.
    Requests not aborted must match token for token; an aborted request's tokens must be a
    prefix of the other engine's (their steps need not line up under pressure)."""
    rng = random.Random(2_000_003 * c["seed"] + 29)
    events = []
    for n in c["max_tokens"]:
        kind = rng.choice(["run", "run", "tokens", "step"])
        events.append({"arrive": 0 if rng.random() < 0.6 else rng.randint(1, 40),
                       "abort_tokens": rng.randint(1, max(1, n - 1)) if kind == "tokens" else None,
                       "abort_step": rng.randint(0, 60) if kind == "step" else None})
    return dict(c, events=events, second=True)


def engine_kwargs(c: dict) -> tuple[dict, dict]:
    """(stock, ulacache) LLM keyword arguments for case ``c``."""
    fam, shape, mml = c["family"], c["shape"], c["max_model_len"]
    layers = shape["num_hidden_layers"]
    tokens = sum(len(p) + m for p, m in zip(c["prompts"], c["max_tokens"]))
    if fam in DSA:
        # The reference CPU MLA path's schedule on every host; with prefix caching, chunked
        # prefill in 512-token steps (the AMX path's mode, at a size that splits prompts).
        base = dict(compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
                    block_size=16, enable_prefix_caching=c["prefix_caching"],
                    enable_chunked_prefill=c["prefix_caching"],
                    max_num_batched_tokens=512 if c["prefix_caching"] else max(mml, 2048))
    else:
        base = dict(enable_prefix_caching=c["prefix_caching"], max_num_batched_tokens=max(mml, 512))
    base.update(max_num_seqs=8, tensor_parallel_size=c["tp"])
    if c.get("spec"):
        base["speculative_config"] = c["spec"]
        layers += shape.get("num_nextn_predict_layers", 0)  # the MTP layer's KV too
    stock = dict(base, kv_backend="vllm", kv_cache_memory_bytes=512 << 20)
    if fam in DSA:  # (per rank: in TP shard mode each rank holds every other token's row)
        host = max(mml + 16, int(tokens * c["fraction"])) // c["tp"]
        device = base["max_num_batched_tokens"] + shape["index_topk"] + 64
        ula = dict(base, kv_backend="ulacache",
                   kv_cache_memory_bytes=int(1.1 * layers * (device * MLA_ROW
                                                             + (device + host) * INDEX_ROW)),
                   ula_host_pool_gib=round(host * layers * MLA_ROW / 2**30 + 0.0005, 4))
    elif fam == "qwen3_next":
        ula = dict(base, kv_backend="ulacache", kv_cache_memory_bytes=256 << 20,
                   ula_arena_force_moves=2)
    else:
        per_token = layers * 2 * KV_HEADS[fam] * 64 * 4
        ula = dict(base, kv_backend="ulacache",
                   kv_cache_memory_bytes=int(max(mml * 1.3, tokens * c["fraction"]) * per_token))
        if c["force_moves"]:
            ula["ula_arena_force_moves"] = c["force_moves"]
    return stock, ula


def omp_shares(n: int) -> list[dict[str, str]]:
    """Disjoint, equal CPU shares for ``n`` in-process engines (one after another if fewer
    CPUs than engines): the OpenMP environment vLLM writes for a worker."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [{} for _ in range(n)]
    k = len(cpus) // n
    return [{"OMP_NUM_THREADS": str(k), "OMP_PROC_BIND": "true",
             "OMP_PLACES": "{" + ",".join(map(str, cpus[i * k:(i + 1) * k])) + "}"}
            for i in range(n)]


def tp_share(tp: int) -> dict[str, str]:
    """Both TP engines' ranks: rank r on the same CPU share in each (vLLM's worker binding)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise SystemExit(f"--tp {tp} binds each rank to CPUs of its own: {len(cpus)} CPU(s) here")
    k = len(cpus) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        ",".join(map(str, cpus[r * k:(r + 1) * k])) for r in range(tp))}


def run_engine(model: str, c: dict, kw: dict, share: dict, timeout: float) -> dict:
    args = dict(model=model, dtype=c["dtype"], mml=c["max_model_len"], prompts=c["prompts"],
                max_tokens=c["max_tokens"], second=c["second"], kw=kw, mark=MARK,
                events=c.get("events"))
    env = {**os.environ, **share, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PARITY_FUZZ_ARGS": json.dumps(args)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        # (under a main guard: TP workers are spawned and re-import the main module)
        f.write("if __name__ == '__main__':\n" + textwrap.indent(ENGINE, "    "))
    # Its own process group: a timeout or an interrupt ends the engine's workers too.
    p = subprocess.Popen([sys.executable, f.name], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    finally:
        os.unlink(f.name)
    try:  # a worker left behind by an engine that did not shut down
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for line in stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return {"crash": f"exit {p.returncode}: " + (stderr or stdout)[-3000:]}


def run_case(c: dict, models: Path, timeout: float) -> dict:
    from ulacache_vllm.models.factory import build_model

    name = c["family"] + "_" + "_".join(f"{k}{v}" for k, v in sorted(c["shape"].items()))
    model = models / name
    if not (model / "config.json").exists():
        build_model(c["family"], str(model), overrides=c["shape"], seed=0)
    stock_kw, ula_kw = engine_kwargs(c)
    t = time.time()
    shares = omp_shares(2) if c["tp"] == 1 else [tp_share(c["tp"])] * 2
    with ThreadPoolExecutor(2) as pool:
        ref_f = pool.submit(run_engine, str(model), c, stock_kw, shares[0], timeout)
        ula_f = pool.submit(run_engine, str(model), c, ula_kw, shares[1], timeout)
        ref, ula = ref_f.result(), ula_f.result()
    out = {k: c[k] for k in ("seed", "tp", "family", "shape", "max_model_len", "prefix_caching",
                             "fraction", "second")}
    out["spec"] = c.get("spec")
    out.update(requests=len(c["prompts"]), ula_kv_bytes=ula_kw["kv_cache_memory_bytes"],
               ula_host_gib=ula_kw.get("ula_host_pool_gib"), wall_s=round(time.time() - t, 1))
    if "crash" in ref or "boot_error" in ref:  # no reference: ulacache's side is told apart
        out["result"] = "stock fails"
        out["detail"] = {"stock": (ref.get("crash") or ref.get("boot_error"))[-1500:],
                         "ulacache": ("refused: " + ula["boot_error"] if "boot_error" in ula
                                      else (ula.get("crash") or "ran")[-1500:])}
    elif "crash" in ula:
        out["result"], out["detail"] = "crash", ula["crash"]
    elif "boot_error" in ula:
        out["result"], out["detail"] = "refused", ula["boot_error"]
    else:
        cut = set(ula.get("aborted", [])) | set(ref.get("aborted", []))

        def agree(i: int, a: list, b: list) -> bool:  # an aborted request: one a prefix
            return a == b or (i in cut and a[:len(b)] == b[:len(a)])

        bad = [i for i, (a, b) in enumerate(zip(ula["out"], ref["out"])) if not agree(i, a, b)]
        same = not bad and ula.get("out2") == ref.get("out2")
        out["result"] = "exact" if same else "mismatch"
        if "aborted" in ula:
            out["aborted"] = {"ulacache": ula["aborted"], "stock": ref["aborted"],
                              "steps": [ula["steps"], ref["steps"]]}
        if not same:
            out["detail"] = {"requests": bad,
                             "second_pass": [i for i, (a, b) in enumerate(
                                 zip(ula.get("out2") or [], ref.get("out2") or [])) if a != b]}
        m = ula["metrics"]
        out["ulacache"] = {k.replace("vllm:ulacache_", "").replace("vllm:", ""): v
                           for k, v in m.items() if v and not k.endswith(("_capacity", "_bytes",
                                                                          "_used"))}
        out["stock"] = {k.replace("vllm:", ""): v for k, v in ref["metrics"].items()}
        # What the pools hold once every request finished, over the ranks (DSA: device + host
        # slots; arena: used bytes). Without prefix caching nothing may be left: a leak.
        out["left"] = sum(u.get("arena_used_bytes",
                                (u.get("device_used") or 0) + (u.get("host_used") or 0))
                          for u in ula["usage"])
        emptied = not c["prefix_caching"] or ula.get("reset") is True
        if out["result"] == "exact" and "reset" in ula and ula["reset"] is not True:
            out["result"], out["detail"] = "leak", "reset_prefix_cache() refused at the end"
        elif out["result"] == "exact" and emptied and out["left"]:
            out["result"], out["detail"] = "leak", f"{out['left']} left in the pools"
    return out


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-19", help="e.g. 0-39 or 3,7,11-15")
    p.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "parity_fuzz_models"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--tp", type=int, default=1, choices=(1, 2),
                   help="tensor parallel size of both engines (2: rank r of each on CPU share r)")
    p.add_argument("--spec", action="store_true",
                   help="speculative decoding on both engines (MTP for DSA and Qwen3-Next, "
                        "n-gram for Gemma 3 and GPT-OSS; `add_speculation`)")
    p.add_argument("--aborts", action="store_true",
                   help="requests arrive at drawn steps and some are aborted (`add_aborts`)")
    p.add_argument("--out", default=None, help="JSON file for every case's record")
    a = p.parse_args(argv)
    models = Path(a.models)
    models.mkdir(parents=True, exist_ok=True)
    records, t0 = [], time.time()
    for seed in parse_seeds(a.seeds):
        c = draw(seed, a.tp)
        c = add_speculation(c) if a.spec else c
        r = run_case(add_aborts(c) if a.aborts else c, models, a.timeout)
        records.append(r)
        moved = {k: v for k, v in (r.get("ulacache") or {}).items()
                 if k in ("demotions", "promotions", "remote_rows_fetched", "arena_compactions",
                          "arena_relayouts", "num_preemptions", "prefix_cache_hits",
                          "spec_decode_num_accepted_tokens")}
        print(f"seed {seed:4d} {r['family']:13s} mml {r['max_model_len']:5d} "
              f"n {r['requests']} pc {int(r['prefix_caching'])} {r['result']:8s} "
              f"{r['wall_s']:6.1f} s {moved}"
              + (f" aborted {r['aborted']['ulacache']}" if "aborted" in r else ""), flush=True)
        if r["result"] != "exact":
            print(f"    {str(r.get('detail'))[:600]}", flush=True)
    counts = {k: sum(r["result"] == k for r in records)
              for k in ("exact", "refused", "mismatch", "leak", "crash", "stock fails")}
    print(f"{len(records)} cases in {time.time() - t0:.0f} s: {counts}")
    if a.out:
        Path(a.out).write_text(json.dumps({"host": cpu_host(), "seeds": a.seeds, "tp": a.tp,
                                           "spec": a.spec, "aborts": a.aborts, "counts": counts,
                                           "cases": records},
                                          indent=1))
    return 1 if counts["mismatch"] or counts["leak"] or counts["crash"] else 0


if __name__ == "__main__":
    sys.exit(main())
