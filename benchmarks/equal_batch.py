"""Equal-batch benchmark: stock vLLM and ulacache on the same batch, step by step.

The batch is held fixed: the same requests (N random-token prompts of L tokens, M output
tokens, greedy, ``ignore_eos``), all admitted at once (``max_num_seqs = N``, the step budget
``max_num_batched_tokens`` pinned so the whole prefill is one step where the mode allows it).
Stock and ulacache run in alternating engine processes (A B A B ..., ``--repeats R``; from
the second repeat on, the order rotates by one each repeat, so no configuration always runs
at the same position: ``--fixed-order`` keeps it) within one invocation, each engine in its own subprocess (this script re-invoked with ``--worker``)
with the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the script times
every engine step itself. Scheduler and cache settings are pinned on both sides (never the
host's defaults): DSA runs vLLM's reference CPU MLA path (``mla_path_kwargs("reference")`` in
``tests/_vllm_subprocess.py``: chunked prefill and prefix caching off, block 16) with an
explicit ``max_num_batched_tokens``; hybrids run prefix caching off (ulacache's arena turns it
off) and chunked prefill on, with an explicit step budget.

Modes (``--modes``, comma list):

  dsa-fast        tiny DeepSeek-V3.2, everything fits the device pool (ulacache's fast path)
  dsa-pressure    ulacache's device pool ``--pressure-frac`` of the batch's tokens, the rest in
                  the host pool (rows demoted and promoted every step); stock holds the whole
                  batch on its device (the D+H bound). The step budget is the largest multiple
                  of L that fits ulacache's device pool (the same on both sides), so the
                  prefill takes several steps.
  dsa-tp2         TP=2: ulacache's default shard mode with each rank's device pool
                  ``--tp2-device-frac`` of the batch's tokens (so the rows leave the replicated
                  start and live as shards) against stock TP=2 holding the batch; each rank's
                  threads bound to a core of its own.
  arena-<model>   qwen3_next, gpt_oss, gemma3: the ulacache arena against stock's default
                  block size and each of ``--block-sizes`` (the best of them is the baseline),
                  a short-prompt and a long-prompt batch in each engine.

Per run: the ``generate`` call's wall time, every engine step's time (the in-process
``LLMEngine.step``) with its scheduled tokens; the decode step time is the mean over the
full-batch decode-only steps (all N requests, one token each); ulacache's store time per step
(``ulacache_usage()["time_s"]``: write / read / copy / begin / exchange) and its counters; a
SHA-256 of the output tokens. Reported per mode and shape: ulacache / stock decode-step ratio
per paired repeat (median, min, max) and the wall-time ratio, and whether the outputs were
token-identical.

``--spec METHOD[:K]``: speculative decoding with the same ``speculative_config`` on both sides
of every mode run: ``mtp[:K]`` (K default 2; the DSA model and Qwen3-Next are built with one MTP
layer, ``models_cache/*-mtp``) or ``ngram[:K]`` (K default 3). A decode step is then one with
no new request and at most 1 + K tokens per request (drafts verified); each run also records
vLLM's ``vllm:spec_decode_*`` counters over the timed ``generate`` (drafts, draft tokens,
accepted tokens), reported per side beside the step-time ratio and the token identity. Files
``equal_batch[_quick]_spec_<method>``.

``--dsa-model-variant stable:RHO[:PE]`` (DSA modes): the DSA model's variant from
``benchmarks/lab/stable_indexer.py`` whose indexer top-k repeats from step to step (the random
model's barely does), built beside the model in ``models_cache``. ``--indexer-overlap`` (implied
by a variant; TP=1 modes): after the pairs, one more ulacache run of the same batch, untimed and
without warm-up, with ulacache's selection trace on; its step-to-step top-k overlap (per
request and layer group) goes into the mode's summary (``indexer_overlap``) with whether that
run's outputs equal stock's. At TP=1 every ulacache run also records its store's counters per
full-batch decode step (``store_counts_per_decode_step``: lookups, hits, promotions, demotions
in the decode steps alone, the prefill's demotions left out).

``--profile``: every engine (both backends alike) also wraps, from this script and without
touching product code, the scheduler's ``schedule`` / ``update_from_output``, the KV cache
manager's ``allocate_slots`` (and the arena's ``allocate``), the connector's
``build_connector_meta`` and worker hooks, the store's timers (``begin`` / ``write`` / ``read``
/ ``copy`` / ``exchange``), the sparse-MLA impl (``forward_mqa``, ``do_kv_cache_update``,
``sparse_mla_attention``), the DSA indexer, vLLM's CPU attention, the arena's ``apply`` /
``translate``, the executor's ``execute_model`` / ``sample_tokens``. Time is attributed
exclusively (a phase's time excludes the wrapped phases inside it), so the phases of a step
add up to the step; ``execute_model`` exclusive is the model compute not otherwise named.
Printed as ms per full-batch decode step, stock and ulacache side by side with the difference.

``--torch-ops`` (TP=1): ``torch.profiler`` (CPU, self time per op) over each run's decode steps
after the first; printed per shape as the ops' summed self time per step on the baseline and
ulacache and the ops that differ most (what the forward itself costs on each side, apart
from the step's Python).

    python benchmarks/equal_batch.py --quick                     # every mode, small
    python benchmarks/equal_batch.py --quick --modes dsa-fast --repeats 1 --profile

Writes ``equal_batch[_quick].json`` (host, vLLM path of every engine, every run) and a PNG
beside it into ``--out`` (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[0]
RESULTS = HERE / "results"
MARK = "@@EQUAL_BATCH@@"
MiB, GiB = 1 << 20, 1 << 30

# vLLM's reference CPU MLA path, pinned (tests/_vllm_subprocess.py mla_path_kwargs("reference"),
# whose max_num_batched_tokens each mode sets itself).
DSA_PATH = dict(enable_chunked_prefill=False, enable_prefix_caching=False, block_size=16)
DSA_DTYPE = "float32"
DSA_KV_BYTES = 64 * MiB  # stock's budget (and ulacache's in dsa-fast): the whole batch fits

# Hybrid models: Qwen3-Next and GPT-OSS as in hybrid_capacity.py (same cached checkpoints),
# Gemma 3 as in tests/test_arena_engine.py.
ARENA_MODELS = {
    "qwen3_next": dict(dir="bench-qwen3-next-h8", dtype="bfloat16",
                       overrides=dict(num_attention_heads=8, num_key_value_heads=8)),
    "gpt_oss": dict(dir="bench-gpt-oss", dtype="float32",
                    overrides=dict(initializer_range=0.1)),
    "gemma3": dict(dir="bench-gemma3", dtype="float32",
                   overrides=dict(initializer_range=0.1, tie_word_embeddings=False)),
}
ARENA_KV_BYTES = 256 * MiB
# DSA store counters recorded per engine step (ulacache, TP=1: the store is in this process)
STEP_COUNTERS = ("lookups", "hits", "promotions", "demotions", "bytes_moved")
MODES = ("dsa-fast", "dsa-pressure", "dsa-tp2") + tuple(f"arena-{m}" for m in ARENA_MODELS)

# Shapes: (requests N, prompt tokens L, output tokens M).
DSA_SHAPE = {"full": (12, 512, 96), "quick": (6, 192, 24)}
# Under pressure the device pool must hold a step (>= 2048 + top-k rows on the reference path),
# so the batch must be >= 3x that for a third of it to be on the device.
PRESSURE_SHAPE = {"full": (12, 512, 96), "quick": (12, 512, 32)}
REFERENCE_MIN_BATCH = 2048  # vLLM's CPU MLA reference path: max(max_model_len, 2048)
ARENA_SHAPES = {
    "full": {"short": (32, 128, 64), "long": (6, 1536, 64)},
    "quick": {"short": (12, 96, 24), "long": (3, 768, 24)},
}
BLOCK_SIZES = {"full": "32,64,128,256", "quick": "32,128"}


# ============================================================================ worker side
class Prof:
    """Exclusive-time attribution over nested wrapped calls (one thread: the in-process
    engine core and, at TP=1, its worker)."""

    def __init__(self) -> None:
        self.excl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.stack: list[list] = []

    def enter(self, key: str):
        self.stack.append([key, time.perf_counter(), 0.0])

    def leave(self) -> None:
        key, t0, child = self.stack.pop()
        dt = time.perf_counter() - t0
        self.excl[key] = self.excl.get(key, 0.0) + dt - child
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.stack:
            self.stack[-1][2] += dt

    def wrap(self, key: str, fn):
        def wrapper(*a, **k):
            self.enter(key)
            try:
                return fn(*a, **k)
            finally:
                self.leave()
        wrapper.__wrapped__ = fn
        return wrapper


def _wrap_attr(prof: Prof, owner, attr: str, key: str) -> bool:
    fn = getattr(owner, attr, None)
    if fn is None:
        return False
    setattr(owner, attr, prof.wrap(key, fn))
    return True


def _install_class_wrappers(prof: Prof) -> list[str]:
    """Module and class attributes, installed before ``LLM(...)`` (looked up at call time)."""
    done = []
    try:
        from ulacache_vllm.engine.dsa import cpu_sparse_mla as csm
        from ulacache_vllm.engine.dsa.cpu_sparse_mla import CpuSparseMLAImpl

        _wrap_attr(prof, csm, "sparse_mla_attention", "attn.sparse_mla_attention")
        _wrap_attr(prof, CpuSparseMLAImpl, "forward_mqa", "attn.mla_forward_mqa")
        _wrap_attr(prof, CpuSparseMLAImpl, "do_kv_cache_update", "attn.mla_kv_write")
        done.append("sparse_mla")
    except ImportError:
        pass
    from ulacache_vllm.engine.arena.worker import ArenaWorker
    from ulacache_vllm.engine.connector import UlaCacheConnector

    _wrap_attr(prof, ArenaWorker, "apply", "arena.apply")
    _wrap_attr(prof, ArenaWorker, "translate", "arena.translate")
    for attr, key in (("build_connector_meta", "sched.build_connector_meta"),
                      ("handle_preemptions", "conn.handle_preemptions"),
                      ("start_load_kv", "conn.start_load_kv"),
                      ("get_kv_connector_stats", "conn.get_kv_connector_stats"),
                      ("get_block_ids_with_load_errors", "conn.load_errors")):
        _wrap_attr(prof, UlaCacheConnector, attr, key)
    done.append("connector")
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        _wrap_attr(prof, CPUAttentionBackendImpl, "forward", "attn.cpu_attention")
        done.append("cpu_attn")
    except ImportError:
        pass
    return done


def _install_engine_wrappers(prof: Prof, llm, profile: bool, cur: dict,
                             spec_k: int = 0) -> dict:
    """Instance attributes of the built engine (scheduler, executor, store). ``spec_k``: draft
    tokens per step (speculative decoding): a decode step schedules 1 + up to K per request."""
    eng = llm.llm_engine
    core = eng.engine_core.engine_core  # InprocClient -> EngineCore
    sch = core.scheduler
    kvm = sch.kv_cache_manager
    orig_schedule = sch.schedule

    def schedule(*a, **k):
        out = orig_schedule(*a, **k)
        n = out.num_scheduled_tokens
        cur["tokens"] = out.total_num_scheduled_tokens
        cur["reqs"] = len(n)
        cur["new"] = len(out.scheduled_new_reqs)
        cur["decode"] = bool(n) and not out.scheduled_new_reqs and (
            max(n.values()) <= 1 + spec_k if spec_k else
            out.total_num_scheduled_tokens == len(n))
        return out

    sch.schedule = prof.wrap("sched.schedule", schedule) if profile else schedule
    info = {"store": _ula_store()}  # (TP=1 ulacache: its per-step timers and counters)
    if not profile:
        return info
    sch.update_from_output = prof.wrap("sched.update_from_output", sch.update_from_output)
    kvm.allocate_slots = prof.wrap("sched.allocate_slots", kvm.allocate_slots)
    arena = getattr(kvm, "arena", None)
    if arena is not None:
        arena.allocate = prof.wrap("sched.arena_allocate", arena.allocate)
    core.step_fn = prof.wrap("core.step", core.step_fn)
    ex = core.model_executor
    ex.execute_model = prof.wrap("model.execute_model", ex.execute_model)
    ex.sample_tokens = prof.wrap("model.sample_tokens", ex.sample_tokens)
    try:  # a CustomOp binds its forward at construction: wrap each built indexer's
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

        def wrap_indexers(model):
            n = 0
            for mod in model.modules():
                if isinstance(mod, SparseAttnIndexer) and hasattr(mod, "_forward_method"):
                    mod._forward_method = prof.wrap("attn.dsa_indexer", mod._forward_method)
                    n += 1
            return n

        info["indexers_wrapped"] = llm.apply_model(wrap_indexers)  # in-process at TP=1
    except Exception as e:  # noqa: BLE001 - TP > 1: the model lives in worker processes
        info["indexers_wrapped"] = repr(e)[:200]
    store = info["store"]  # TP=1: its timers feed the profile too
    if store is not None:
        import contextlib

        orig_timed = store.state.timed  # what the store and each of its parts time with

        @contextlib.contextmanager
        def timed(key):
            with orig_timed(key):
                prof.enter(f"store.{key}")
                try:
                    yield
                finally:
                    prof.leave()

        store.state.timed = timed
        info["store"] = store
    return info


def _ula_store():
    """The DSA worker store when the worker is in this process (ulacache, TP=1), else None."""
    try:
        from ulacache_vllm.engine.connector import ula_connector

        conn = ula_connector()
        store = getattr(getattr(conn, "worker", None), "store", None)
        return store if hasattr(store, "totals") and hasattr(store, "time_s") else None
    except Exception:  # noqa: BLE001 - no connector (stock) or not in this process
        return None


def _spec_bytes(llm) -> dict:
    """Bytes per token of the engine's KV specs per layer (rank 0), MLA rows and DSA indexer
    keys apart (as ulacache's sizing splits them)."""
    out = {"mla": 0, "indexer": 0, "other": 0, "n_mla": 0, "n_indexer": 0}
    try:
        specs = llm.llm_engine.engine_core.engine_core.model_executor.get_kv_cache_specs()[0]
        from ulacache_vllm.engine.dsa.sizing import split_specs

        mla, idx, other = split_specs(specs)
    except Exception as e:  # noqa: BLE001 - informational
        out["error"] = repr(e)
        return out
    for key, group in (("mla", mla), ("indexer", idx), ("other", other)):
        for s in group.values():
            out[key] += s.page_size_bytes // s.block_size
        if key != "other":
            out[f"n_{key}"] = len(group)
    return out


def _summ(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "min": s[0],
            "max": s[-1], "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "n": len(s)}


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _hist(llm, name: str) -> tuple[int, float]:
    count, total = 0, 0.0
    for m in llm.get_metrics():
        if m.name == name and hasattr(m, "count"):
            count += m.count
            total += m.sum
    return count, total


def _spec_counts(llm) -> dict:
    """vLLM's speculative-decoding counters (log stats on): drafts, draft and accepted tokens."""
    return {m.name[len("vllm:spec_decode_"):]: m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                          "vllm:spec_decode_num_accepted_tokens")}


def _worker(cfg: dict) -> dict:
    import hashlib

    import numpy as np

    if cfg.get("pin_cpu") is not None:  # before torch starts its OpenMP threads
        os.sched_setaffinity(0, {cfg["pin_cpu"]})
    prof = Prof()
    wrapped = _install_class_wrappers(prof) if cfg["profile"] else []
    from vllm import LLM, SamplingParams

    if cfg.get("trace_path"):  # --indexer-overlap's extra run: ulacache's selection trace
        cfg["llm_kw"] = dict(cfg["llm_kw"], ula_trace_path=cfg["trace_path"])
    t_boot = time.perf_counter()
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enforce_eager=True, seed=0,
              **cfg["llm_kw"])
    boot_s = time.perf_counter() - t_boot
    eng = llm.llm_engine
    sch = eng.engine_core.engine_core.scheduler
    cur: dict = {}
    info = _install_engine_wrappers(prof, llm, cfg["profile"], cur,
                                    (cfg["llm_kw"].get("speculative_config") or {}).get(
                                        "num_speculative_tokens", 0))
    store = info["store"]
    steps: list[dict] = []
    orig_step = eng.step
    inner_step = prof.wrap("engine.step", orig_step) if cfg["profile"] else orig_step

    # --torch-ops: torch.profiler (CPU, self time per op) over the timed run's decode
    # steps after the first (TP=1: the forward runs in this process).
    tprof = {"armed": False, "timed": False, "p": None, "steps": 0}

    def step():
        if cfg.get("torch_ops") and tprof["armed"] and tprof["p"] is None:
            from torch.profiler import ProfilerActivity, profile as tprofile

            tprof["p"] = tprofile(activities=[ProfilerActivity.CPU])
            tprof["p"].start()
        before = dict(prof.excl)
        st0 = dict(store.time_s) if store is not None else None
        sc0 = store.totals() if store is not None else None
        cur.clear()
        ru0 = resource.getrusage(resource.RUSAGE_THREAD)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = inner_step()
        t1 = time.perf_counter()
        ru1 = resource.getrusage(resource.RUSAGE_THREAD)
        # CPU time of this thread (the in-process engine core and, at TP=1, its worker) and
        # its page faults: a step stretched by other processes shows wall > cpu; a step doing
        # first-touch work shows minor faults.
        rec = {"t": t1 - t0, "cpu": time.thread_time() - c0,
               "minflt": ru1.ru_minflt - ru0.ru_minflt, "tokens": cur.get("tokens", 0),
               "reqs": cur.get("reqs", 0), "new": cur.get("new", 0),
               "decode": cur.get("decode", False)}
        if cfg["profile"]:
            rec["ph"] = {k: v - before.get(k, 0.0) for k, v in prof.excl.items()
                         if v != before.get(k, 0.0)}
        if st0 is not None:
            rec["store"] = {k: v - st0.get(k, 0.0) for k, v in store.time_s.items()}
            sc1 = store.totals()
            rec["counts"] = {k: sc1[k] - sc0[k] for k in STEP_COUNTERS}
        steps.append(rec)
        if tprof["p"] is not None:
            tprof["steps"] += 1
        elif rec["decode"] and tprof["timed"]:
            tprof["armed"] = True  # from the next step on
        return out

    eng.step = step
    ula = cfg["backend"] == "ulacache"
    arena = getattr(sch.kv_cache_manager, "arena", None) is not None

    def usage():
        if not ula:
            return None
        return llm.collective_rpc("ulacache_usage")

    from _host import engine_path

    u0 = usage()
    if "indexers_wrapped" in info:
        wrapped.append(f"indexers: {info['indexers_wrapped']}")
    res = {"name": cfg["name"], "backend": cfg["backend"], "boot_s": boot_s,
           "wrapped": wrapped, "engine_path": engine_path(llm, (u0 or [None])[0]),
           "spec_bytes": _spec_bytes(llm), "llm_kw": cfg["llm_kw"],
           "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
           "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": _torch_threads(),
           "shapes": {}}
    if u0 and not arena:
        r0 = u0[0]
        groups = max(1, len(r0.get("victim_paths") or [1]))
        res["ula_layout"] = {"device_slots": r0["device_capacity"] // groups,
                             "host_slots": r0["host_capacity"] // groups,
                             "num_logical": r0.get("num_logical"), "tp_mode": r0.get("tp_mode"),
                             "groups": groups, "remote_capacity": r0.get("remote_capacity")}
    if u0 and arena:
        res["arena"] = {k: v for k, v in u0[0].items()
                        if isinstance(v, (int, float, str)) and k.startswith("arena")}
    vocab_hi = 1000  # tiny models' vocab is 1024: stay clear of the special ids at the top
    for shape, (n, plen, olen) in cfg["shapes"].items():
        rng = np.random.default_rng(plen * 1000 + n)  # the same prompts on every run
        prompts = [{"prompt_token_ids": rng.integers(10, vocab_hi, plen).tolist()}
                   for _ in range(n)]
        warm = [{"prompt_token_ids": rng.integers(10, vocab_hi, plen).tolist()}
                for _ in range(n)]
        sp = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
        if cfg["warmup"]:  # first-use costs of kernels and paths out of the timed run
            llm.generate(warm, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
        ua = usage()
        h0 = _hist(llm, "vllm:inter_token_latency_seconds")
        sc0 = _spec_counts(llm) if cfg["llm_kw"].get("speculative_config") else None
        steps.clear()
        prof.calls.clear()
        tprof.update(armed=False, timed=True, p=None, steps=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        tprof["timed"] = False
        torch_ops = None
        if tprof["p"] is not None:
            tprof["p"].stop()
            k = max(1, tprof["steps"])
            ops = sorted(((e.key, e.self_cpu_time_total) for e in tprof["p"].key_averages()),
                         key=lambda kv: -kv[1])
            torch_ops = {"steps": tprof["steps"],
                         "total_ms_per_step": sum(t for _, t in ops) / k / 1000,
                         "ops_ms_per_step": {n: t / k / 1000 for n, t in ops[:60]}}
        h1 = _hist(llm, "vllm:inter_token_latency_seconds")
        sc1 = _spec_counts(llm) if sc0 is not None else None
        ub = usage()
        toks = [list(o.outputs[0].token_ids) for o in outs]
        # vLLM's per-request stats (log stats on): first -> last token over the later tokens.
        tpots = []
        for o in outs:
            m = getattr(o, "metrics", None)
            first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
            if m is not None and last > first and len(o.outputs[0].token_ids) > 1:
                tpots.append(1000 * (last - first) / (len(o.outputs[0].token_ids) - 1))
        full = [s for s in steps if s["decode"] and s["reqs"] == n]
        prefill = [s for s in steps if s["tokens"] and not s["decode"]]
        r = {"requests": n, "prompt_len": plen, "max_tokens": olen, "wall_s": wall,
             "steps": len(steps), "prefill_steps": len(prefill),
             "decode_steps_full": len(full),
             "decode_steps_partial": sum(1 for s in steps if s["decode"] and s["reqs"] != n),
             "empty_steps": sum(1 for s in steps if not s["tokens"]),
             "decode_ms": _summ([1000 * s["t"] for s in full]),
             "decode_steps_ms": [round(1000 * s["t"], 3) for s in full],
             "decode_steps_cpu_ms": [round(1000 * s["cpu"], 3) for s in full],
             "decode_steps_minflt": [s["minflt"] for s in full],
             "prefill_ms_total": 1000 * sum(s["t"] for s in prefill),
             "all_steps_ms_total": 1000 * sum(s["t"] for s in steps),
             "out_tokens": sum(map(len, toks)),
             "tokens_sha256": hashlib.sha256(json.dumps(toks).encode()).hexdigest(),
             "itl_ms_mean": (1000 * (h1[1] - h0[1]) / (h1[0] - h0[0])) if h1[0] > h0[0]
             else None,
             "request_tpot_ms_mean": statistics.fmean(tpots) if tpots else None}
        if torch_ops is not None:
            r["torch_ops"] = torch_ops
        if cfg.get("trace_path"):  # (no warm-up in this run: the trace is this generate's)
            from lab.stable_indexer import overlap_from_trace

            r["indexer_overlap"] = overlap_from_trace(cfg["trace_path"], cfg["topk"])
        if sc0 is not None:  # drafts judged in the timed run, and the acceptance rate
            sd = {k: v - sc0.get(k, 0) for k, v in sc1.items()}
            sd["acceptance"] = sd.get("num_accepted_tokens", 0) / max(
                1, sd.get("num_draft_tokens", 0))
            r["spec_decode"] = sd
        if cfg["profile"] and full:
            keys = sorted({k for s in full for k in s["ph"]})
            # Every full-batch decode step, and the faster half of them (steps a busy host
            # stalled left out; the phases still add up to those steps' mean).
            fast = sorted(full, key=lambda s: s["t"])[:max(1, len(full) // 2)]
            for label, sel in (("phases_ms_per_decode_step", full),
                               ("phases_ms_per_decode_step_fast_half", fast)):
                r[label] = {k: 1000 * sum(s["ph"].get(k, 0.0) for s in sel) / len(sel)
                            for k in keys}
            r["phase_calls_timed_run"] = dict(prof.calls)
            # The first decode steps one by one (where a warm-up effect would show).
            r["phases_ms_first_decode_steps"] = [
                {k: round(1000 * v, 3) for k, v in sorted(s["ph"].items())} for s in full[:8]]
        if store is not None and full:
            r["store_ms_per_decode_step"] = {
                k: 1000 * sum(s["store"][k] for s in full) / len(full) for k in store.time_s}
            # the store's counters in the full-batch decode steps only (prefill's demotions
            # of rows that do not fit the device pool left out), per step
            r["store_counts_per_decode_step"] = {
                k: sum(s["counts"][k] for s in full) / len(full) for k in STEP_COUNTERS}
        if ua is not None and ub is not None:
            per_rank = []
            for a, b in zip(ua, ub):
                d = {"time_ms": {k: 1000 * (b["time_s"][k] - a["time_s"].get(k, 0.0))
                                 for k in b.get("time_s", {})}} if "time_s" in b else {}
                if "totals" in b:
                    d["totals"] = {k: b["totals"][k] - a["totals"].get(k, 0)
                                   for k in b["totals"] if isinstance(b["totals"][k], (int, float))}
                if arena:
                    d["arena"] = {k: b[k] - a[k] for k in b if k.startswith("arena_")
                                  and isinstance(b[k], (int, float)) and k in a}
                d["identity_mode_end"] = b.get("identity_mode")
                per_rank.append(d)
            r["ulacache"] = per_rank
        res["shapes"][shape] = r
        print(f"[{cfg['name']}] {shape}: wall {wall:.2f} s, decode "
              f"{(r['decode_ms'] or {}).get('mean', float('nan')):.2f} ms/step "
              f"({len(full)} full steps)", file=sys.stderr, flush=True)
    return res


# ============================================================================ driver side
def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _idlest_cpu(cpus: list[int], window: float = 0.5) -> int:
    """The CPU of ``cpus`` with the most idle time over ``window`` seconds (/proc/stat)."""
    def sample():
        out = {}
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3:4].isdigit():
                    parts = line.split()
                    vals = list(map(int, parts[1:]))
                    out[int(parts[0][3:])] = (vals[3] + vals[4], sum(vals))
        return out
    try:
        a = sample()
        time.sleep(window)
        b = sample()
        idle = {c: (b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in cpus if c in a}
        return max(idle, key=idle.get) if idle else cpus[0]
    except OSError:
        return cpus[0]


def _bind(tp: int, arg: str) -> tuple[str, int | None]:
    """(VLLM_CPU_OMP_THREADS_BIND, CPU to pin a TP=1 engine's process to). TP > 1: one CPU per
    rank from this process's CPUs (vLLM binds each worker process and gives it one OpenMP
    thread per CPU). TP = 1: the engine runs in the script's process, where vLLM binds nothing
    (torch would run one OpenMP thread per CPU of the machine, and OpenMP threads spinning
    against other processes' on a shared host stall whole steps): the process is pinned to
    one CPU with one OpenMP thread, as vLLM's own binding gives a single-rank engine on a
    2-core host; ``--bind auto`` picks the idlest CPU at each run's start."""
    cpus = _cpus()
    if tp > 1:
        if arg != "auto" and "|" in arg:
            return arg, None
        if len(cpus) < tp:
            raise SystemExit(f"TP={tp} needs {tp} CPUs of its own; this process may use {cpus}")
        return "|".join(str(c) for c in cpus[:tp]), None
    cpu = _idlest_cpu(cpus) if arg == "auto" else int(arg)
    return str(cpu), cpu


def _spawn(cfg: dict, bind: str, pin: int | None, timeout: float) -> dict:
    env = dict(os.environ)
    for k in ("VLLM_CPU_KVCACHE_SPACE", "TRITON_INTERPRET"):
        env.pop(k, None)
    if pin is not None:  # TP=1, engine in this process: one OpenMP thread on one CPU
        env["OMP_NUM_THREADS"] = "1"
        cfg = dict(cfg, pin_cpu=pin)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: step timing
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(REPO),
                                                    env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                             capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"name": cfg["name"], "failed": f"timed out after {timeout} s",
                "stderr_tail": err[-4000:]}
    for line in out.stdout.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
            res["process_s"] = time.perf_counter() - t
            return res
    return {"name": cfg["name"], "failed": f"exit {out.returncode}",
            "stderr_tail": out.stderr[-6000:], "stdout_tail": out.stdout[-1500:]}


def _model(name: str, overrides: dict | None, dirname: str) -> str:
    from ulacache_vllm.models import build_model

    path = REPO / "models_cache" / dirname
    if not (path / "config.json").exists():
        build_model(name, path, overrides=overrides or None)
    return str(path)


def _dsa_model(args) -> str:
    if args.model:
        model = args.model
    elif _spec_config(args.spec or "").get("method") == "mtp":
        model = _model("deepseek_v32", {"num_nextn_predict_layers": 1}, "bench-deepseek-v32-mtp")
    else:
        model = _model("deepseek_v32", None, "bench-deepseek-v32")
    v = _variant_rho(args)
    if v is None:
        return model
    from lab.stable_indexer import build_variant

    return str(build_variant(model, *v))


def _variant_rho(args) -> tuple[float, float] | None:
    """--dsa-model-variant stable:RHO[:PE] (benchmarks/lab/stable_indexer.py): (RHO, PE);
    None: the model itself."""
    from lab.stable_indexer import parse_variant

    return parse_variant(getattr(args, "dsa_model_variant", None))


def _spec_config(arg: str) -> dict:
    """``--spec METHOD[:K]`` as vLLM's speculative_config ({} without --spec)."""
    from _spec import spec_config

    return spec_config(arg)


def _rup(x: float, a: int) -> int:
    return int(math.ceil(x / a)) * a


def ula_dsa_budget(spec: dict, bs: int, device_slots: int, host_slots: int, shards: int = 1,
                   remote: int = 0) -> int:
    """kv_cache_memory_bytes giving ulacache's DSA layout ``device_slots`` device rows per
    rank (ulacache_vllm/engine/dsa/sizing.py ``plan_layout``, solved for the budget):
    placeholders and indexer keys per local token, ``remote`` buffer rows, half a block of
    slack against the rounding down to whole blocks."""
    M, I = spec["mla"], spec["indexer"]
    lp = spec["n_mla"] + (spec["n_indexer"] if shards > 1 else 0)
    per_local = shards * (lp + (I if shards == 1 else 0)) + (I if shards > 1 else 0)
    lbs = bs // shards
    return (host_slots * per_local + remote * M + device_slots * (per_local + M)
            + (lbs // 2) * (per_local + M))


def host_gib(spec: dict, host_slots: int) -> float:
    """ula_host_pool_gib holding ``host_slots`` rows (sizing.host_tokens_of floors)."""
    return (host_slots * spec["mla"] + spec["mla"] // 2) / GiB


def plan_mode(mode: str, args) -> dict:
    """A mode's model, shapes and configurations. ``configs``: name -> dict(backend, llm_kw,
    tp, sized) where ``sized`` names the sizing to finish from stock's spec bytes."""
    q = "quick" if args.quick else "full"
    if mode.startswith("dsa-"):
        shapes = PRESSURE_SHAPE if mode == "dsa-pressure" else DSA_SHAPE
        n, plen, olen = args.dsa_shape or shapes[q]
        model = _dsa_model(args)
        topk = json.loads((Path(model) / "config.json").read_text()).get("index_topk", 0)
        bs = DSA_PATH["block_size"]
        batch_tokens = n * _rup(plen + olen, bs)  # blocks the batch holds at its end
        # The reference path fixes the step budget at max(max_model_len, 2048) (vLLM's CPU
        # platform); pinned here to that value. One-step prefill: max_model_len >= N x L.
        mml = plen + olen if mode == "dsa-pressure" else max(plen + olen, n * plen)
        budget = max(mml, REFERENCE_MIN_BATCH)
        base = dict(DSA_PATH, max_model_len=mml, max_num_seqs=n, max_num_batched_tokens=budget)
        tp = 2 if mode == "dsa-tp2" else 1
        plan = {"model": model, "dtype": DSA_DTYPE, "tp": tp,
                "model_variant": getattr(args, "dsa_model_variant", None) or "random",
                "shapes": {"batch": (n, plen, olen)}, "baseline": "stock",
                "batch_tokens": batch_tokens, "topk": topk, "step_budget": budget,
                "prefill_steps_expected": -(-n // max(1, budget // plen))}
        if mode == "dsa-fast":
            kw = dict(base, kv_cache_memory_bytes=DSA_KV_BYTES)
            plan["configs"] = {
                "stock": dict(backend="vllm", llm_kw=dict(kw, kv_backend="vllm")),
                "ulacache": dict(backend="ulacache", llm_kw=dict(kw, kv_backend="ulacache"),
                                 sized="fast")}
            plan["description"] = ("everything fits the device pool (ulacache's fast path), "
                                   f"same KV budget on both sides ({DSA_KV_BYTES >> 20} MiB), "
                                   f"prefill in one step (step budget {budget})")
        elif mode == "dsa-pressure":
            # The device pool must hold one step's writes + top-k (sizing.plan_layout).
            dev = _rup(max(args.pressure_frac * batch_tokens, budget + topk), bs)
            plan["device_slots"] = dev
            plan["host_slots"] = max(_rup(batch_tokens - dev + 2 * bs, bs), _rup(mml + bs, bs))
            plan["configs"] = {
                "stock": dict(backend="vllm", llm_kw=dict(base, kv_backend="vllm",
                                                          kv_cache_memory_bytes=DSA_KV_BYTES)),
                "ulacache": dict(backend="ulacache", llm_kw=dict(base, kv_backend="ulacache"),
                                 sized="pressure")}
            plan["description"] = (f"ulacache device pool {dev} rows = "
                                   f"{dev / batch_tokens:.2f} of the batch's {batch_tokens} "
                                   f"tokens, the rest in the host pool; stock holds the whole "
                                   f"batch on the device (the D+H bound); step budget {budget} "
                                   f"tokens on both sides (reference path: prefill in "
                                   f"{plan['prefill_steps_expected']} steps)")
        else:
            lbs = bs // 2
            dev = _rup(max(args.tp2_device_frac * batch_tokens,
                           -(-budget // 2) + n + -(-topk // 2)), lbs)
            plan["device_slots"] = dev
            plan["host_slots"] = _rup(-(-mml // 2) + lbs, lbs)
            plan["remote_rows"] = _rup(n * topk, lbs)
            kw = dict(base, tensor_parallel_size=2)
            plan["configs"] = {
                "stock": dict(backend="vllm", tp=2,
                              llm_kw=dict(kw, kv_backend="vllm",
                                          kv_cache_memory_bytes=DSA_KV_BYTES)),
                "ulacache": dict(backend="ulacache", tp=2,
                                 llm_kw=dict(kw, kv_backend="ulacache", ula_tp_mode="shard",
                                             ula_remote_buffer_rows=plan["remote_rows"]),
                                 sized="tp2")}
            plan["description"] = (f"TP=2, ulacache shard mode with {dev} device rows per rank "
                                   f"({dev / batch_tokens:.2f} of the batch's {batch_tokens} "
                                   f"tokens: sharded, all on the device) against stock TP=2 "
                                   f"holding the batch on every rank; prefill in one step")
        return plan
    name = mode[len("arena-"):]
    m = ARENA_MODELS[name]
    shapes = dict(ARENA_SHAPES[q])
    if args.arena_shapes:
        shapes = {s: shapes[s] for s in args.arena_shapes.split(",")}
    if getattr(args, "arena_out", None):  # longer decodes: more full-batch steps per run
        shapes = {s: (n, p, args.arena_out) for s, (n, p, _) in shapes.items()}
    mml = max(p + o for _, p, o in shapes.values())
    mml = _rup(mml, 256)
    step_budget = max(max(n * p for n, p, _ in shapes.values()), mml)
    base = dict(max_model_len=mml, max_num_seqs=max(n for n, _, _ in shapes.values()),
                enable_prefix_caching=False, enable_chunked_prefill=True,
                max_num_batched_tokens=step_budget, kv_cache_memory_bytes=ARENA_KV_BYTES)
    configs = {"stock": dict(backend="vllm", llm_kw=dict(base, kv_backend="vllm"))}
    for b in (args.block_sizes or BLOCK_SIZES[q]).split(","):
        if b:
            configs[f"stock-bs{b}"] = dict(backend="vllm", llm_kw=dict(
                base, kv_backend="vllm", block_size=int(b)))
    configs["ulacache"] = dict(backend="ulacache", llm_kw=dict(base, kv_backend="ulacache"))
    for b in (args.ula_block_sizes or "").split(","):
        if b:  # the arena with another attention page (a user's --block-size)
            configs[f"ulacache-bs{b}"] = dict(backend="ulacache", llm_kw=dict(
                base, kv_backend="ulacache", block_size=int(b)))
    mtp = _spec_config(args.spec or "").get("method") == "mtp"
    if mtp and name != "qwen3_next":
        raise SystemExit(f"--spec mtp: arena-{name} has no MTP layer (use ngram)")
    model = (_model(name, dict(m["overrides"], num_nextn_predict_layers=1), m["dir"] + "-mtp")
             if mtp else _model(name, m["overrides"], m["dir"]))
    return {"model": model, "dtype": m["dtype"], "tp": 1,
            "shapes": shapes, "configs": configs, "baseline": "stock",
            "description": (f"tiny {name} ({m['dtype']}), the ulacache arena against stock's "
                            f"default block and block sizes {list(configs)[1:-1]}; prefix "
                            f"caching off and chunked prefill on for all, step budget "
                            f"{step_budget}, KV budget {ARENA_KV_BYTES >> 20} MiB (all fit)")}


def _size_ula(plan: dict, cfg: dict, spec: dict) -> None:
    """Finish ulacache's DSA budget from stock's spec bytes (MLA row and indexer key sizes)."""
    kw = cfg["llm_kw"]
    bs = DSA_PATH["block_size"]
    mml = kw["max_model_len"]
    if cfg["sized"] == "fast":
        hs = _rup(mml + bs, bs)
        kw["ula_host_pool_gib"] = host_gib(spec, hs)
    elif cfg["sized"] == "pressure":
        kw["ula_host_pool_gib"] = host_gib(spec, plan["host_slots"])
        kw["kv_cache_memory_bytes"] = ula_dsa_budget(spec, bs, plan["device_slots"],
                                                     plan["host_slots"])
    elif cfg["sized"] == "tp2":
        kw["ula_host_pool_gib"] = host_gib(spec, plan["host_slots"])
        kw["kv_cache_memory_bytes"] = ula_dsa_budget(spec, bs, plan["device_slots"],
                                                     plan["host_slots"], shards=2,
                                                     remote=plan["remote_rows"])
    cfg["sized_done"] = True


def _ratio_stats(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def _decode_mean(run: dict, shape: str, stat: str = "mean") -> float | None:
    sh = (run.get("shapes") or {}).get(shape) or {}
    return (sh.get("decode_ms") or {}).get(stat)


def summarize(plan: dict, runs: list[dict]) -> dict:
    """Per shape: ulacache / baseline per paired repeat (decode step and wall), and for
    hybrids also against the best stock configuration (lowest median decode step)."""
    out = {}
    ok = [r for r in runs if not r.get("failed")]
    names = list(plan["configs"])
    for shape in plan["shapes"]:
        by = {n: {} for n in names}
        for r in ok:
            by[r["config"]][r["repeat"]] = r
        med = {n: statistics.median(v) for n in names
               if (v := [x for r in by[n].values() if (x := _decode_mean(r, shape))])}
        med_step = {n: statistics.median(v) for n in names
                    if (v := [x for r in by[n].values()
                              if (x := _decode_mean(r, shape, "median"))])}
        stock_names = [n for n in names if not n.startswith("ulacache") and not n.endswith("-aa")
                       and n in med_step]
        # The best stock configuration: the lowest median decode step (median over repeats;
        # less moved by a stalled step than the mean on a shared host).
        best = min(stock_names, key=lambda n: med_step[n]) if stock_names else None
        s = {"decode_ms_median_by_config": med, "decode_ms_median_step_by_config": med_step,
             "best_stock": best}
        hashes = {n: sorted({r["shapes"][shape]["tokens_sha256"] for r in by[n].values()
                             if shape in r.get("shapes", {})}) for n in names}
        s["tokens_sha256_by_config"] = hashes
        # Speculative decoding (--spec): each side's counters over its timed runs, per repeat.
        sd = {n: [r["shapes"][shape]["spec_decode"] for _, r in sorted(by[n].items())
                  if (r.get("shapes", {}).get(shape) or {}).get("spec_decode")] for n in names}
        if any(sd.values()):
            s["spec_decode_by_config"] = {n: v for n, v in sd.items() if v}
        base_h = hashes.get(plan["baseline"]) or []
        s["tokens_identical"] = {n: (len(h) == 1 and h == base_h) for n, h in hashes.items()
                                 if h}
        s["block_size_by_config"] = {n: next((r["engine_path"]["block_size"]
                                              for r in by[n].values()), None) for n in names}
        for label, base in (("vs_stock", plan["baseline"]), ("vs_best_stock", best)):
            if base is None or (label == "vs_best_stock" and base == plan["baseline"]
                                and "vs_stock" in s):
                if label == "vs_best_stock" and "vs_stock" in s:
                    s[label] = dict(s["vs_stock"], baseline=base)
                continue
            step_r, med_r, min_r, wall_r = [], [], [], []
            for rep, u in by["ulacache"].items():
                b = by[base].get(rep)
                if b is None:
                    continue
                us, bs_ = u["shapes"].get(shape), b["shapes"].get(shape)
                if not us or not bs_:
                    continue
                um, bm = _decode_mean(u, shape), _decode_mean(b, shape)
                if um and bm:
                    step_r.append(um / bm)
                um, bm = _decode_mean(u, shape, "median"), _decode_mean(b, shape, "median")
                if um and bm:
                    med_r.append(um / bm)
                um, bm = _decode_mean(u, shape, "min"), _decode_mean(b, shape, "min")
                if um and bm:
                    min_r.append(um / bm)
                wall_r.append(us["wall_s"] / bs_["wall_s"])
            # step_ratio: mean decode step (total decode time / full-batch decode steps);
            # step_ratio_median: median decode step (robust to a stalled step on a busy host);
            # step_ratio_min: fastest decode step (the least disturbed one on a shared host).
            s[label] = {"baseline": base, "step_ratio": _ratio_stats(step_r),
                        "step_ratio_median": _ratio_stats(med_r),
                        "step_ratio_min": _ratio_stats(min_r),
                        "wall_ratio": _ratio_stats(wall_r)}
        # Every other configuration against the baseline, mean decode step per paired repeat
        # (a stock block size equal to the default's is the A/A control: the noise floor).
        s["vs_stock_by_config"] = {}
        for n in names:
            if n == plan["baseline"]:
                continue
            rs = [um / bm for rep, r in by[n].items() if (b := by[plan["baseline"]].get(rep))
                  and (um := _decode_mean(r, shape)) and (bm := _decode_mean(b, shape))]
            if rs:
                s["vs_stock_by_config"][n] = _ratio_stats(rs)
        # ulacache's own figures per engine step (every step of the timed run; rank 0 and,
        # at TP > 1, each rank): store time (DSA) and counters, medians over repeats.
        store, counters = {}, {}
        for r in by["ulacache"].values():
            sh = r["shapes"].get(shape) or {}
            for rank, u in enumerate(sh.get("ulacache") or []):
                steps = max(1, sh["steps"])
                for k, v in (u.get("time_ms") or {}).items():
                    store.setdefault(f"rank{rank}", {}).setdefault(k, []).append(v / steps)
                for k, v in {**(u.get("totals") or {}), **(u.get("arena") or {})}.items():
                    counters.setdefault(f"rank{rank}", {}).setdefault(k, []).append(v)
        s["ulacache_store_ms_per_step"] = {rk: {k: statistics.median(v) for k, v in d.items()}
                                           for rk, d in store.items()}
        s["ulacache_counters"] = {rk: {k: statistics.median(v) for k, v in d.items() if any(v)}
                                  for rk, d in counters.items()}
        dec = [sh["store_counts_per_decode_step"] for r in by["ulacache"].values()
               if (sh := r["shapes"].get(shape) or {}).get("store_counts_per_decode_step")]
        if dec:  # rank 0, full-batch decode steps only; medians over repeats
            s["ulacache_counts_per_decode_step"] = {
                k: statistics.median(d[k] for d in dec) for k in dec[0]}
        out[shape] = s
    return out


PHASE_ORDER = [
    ("engine.step", "front end: output processing, stats (engine.step excl.)"),
    ("core.step", "engine core glue (core.step excl.)"),
    ("sched.schedule", "scheduler, rest of schedule()"),
    ("sched.allocate_slots", "scheduler: KV manager allocate_slots"),
    ("sched.arena_allocate", "scheduler: arena allocate (ladder)"),
    ("sched.build_connector_meta", "scheduler: connector build_connector_meta"),
    ("sched.update_from_output", "scheduler: update_from_output"),
    ("conn.handle_preemptions", "worker: connector handle_preemptions (excl.)"),
    ("arena.apply", "worker: arena apply"),
    ("arena.translate", "worker: arena translate (block tables)"),
    ("conn.start_load_kv", "worker: connector start_load_kv (excl.)"),
    ("store.begin", "worker: store begin_step (frees, settle, round; excl.)"),
    ("store.write", "worker: store writes (excl. copies)"),
    ("store.copy", "worker: store copies (demote/promote)"),
    ("store.read", "forward: resolve (store read, excl.)"),
    ("store.exchange", "forward: TP exchange"),
    ("attn.mla_kv_write", "forward: MLA KV write (do_kv_cache_update)"),
    ("attn.dsa_indexer", "forward: DSA indexer (top-k)"),
    ("attn.mla_forward_mqa", "forward: sparse MLA wrapper (positions, rows; excl.)"),
    ("attn.sparse_mla_attention", "forward: sparse_mla_attention (gather + math)"),
    ("attn.cpu_attention", "forward: vLLM CPU attention"),
    ("conn.get_kv_connector_stats", "worker: connector stats"),
    ("conn.load_errors", "worker: connector lost blocks"),
    ("model.execute_model", "rest: model compute + runner (execute_model excl.)"),
    ("model.sample_tokens", "sampling (sample_tokens excl.)"),
]


def profile_table(plan: dict, runs: list[dict], which: str = "fast_half") -> dict:
    """Median over repeats of ms per full-batch decode step per phase, per config (``which``:
    "fast_half": the faster half of each run's decode steps; "all": every decode step)."""
    out = {}
    ok = [r for r in runs if not r.get("failed") and not r.get("duplicate_of")]
    key = "phases_ms_per_decode_step" + ("_fast_half" if which == "fast_half" else "")
    for shape in plan["shapes"]:
        per = {}
        for n in plan["configs"]:
            rows = [r["shapes"][shape].get(key) for r in ok
                    if r["config"] == n and shape in r.get("shapes", {})]
            rows = [x for x in rows if x]
            if not rows:
                continue
            keys = sorted({k for x in rows for k in x})
            per[n] = {k: statistics.median(x.get(k, 0.0) for x in rows) for k in keys}
            per[n]["total"] = statistics.median(sum(x.values()) for x in rows)
        if per:
            out[shape] = per
    return out


def _fmt_profile(mode: str, plan: dict, prof: dict, summary: dict) -> list[str]:
    lines = []
    for shape, per in prof.items():
        if "ulacache" not in per:
            continue
        bases = [plan["baseline"]]
        best = summary.get(shape, {}).get("best_stock")
        if best and best not in bases and best in per:
            bases.append(best)
        bases = [b for b in bases if b in per]
        if not bases:
            continue
        cols = bases + ["ulacache"] + [f"ula - {b}" for b in bases]
        w = max(14, max(len(c) for c in cols) + 2)
        lines.append(f"\n-- {mode} / {shape}: ms per full-batch decode step, by phase "
                     f"(exclusive; the faster half of each run's decode steps, median over "
                     f"repeats; every step: profile_all_steps in the JSON) --")
        if plan.get("tp", 1) > 1:
            lines.append("(TP > 1: the workers run in their own processes, outside these "
                         "wrappers; their time shows as the engine core's wait in core.step. "
                         "The store's per-rank time is in the summary above.)")
        lines.append(f"{'phase':<58}" + "".join(f"{c:>{w}}" for c in cols))
        known = [k for k, _ in PHASE_ORDER]
        extra = sorted({k for v in per.values() for k in v} - set(known) - {"total"})
        for key, label in PHASE_ORDER + [(k, k) for k in extra] + [("total", "total (step)")]:
            vals = [per[b].get(key, 0.0) for b in bases] + [per["ulacache"].get(key, 0.0)]
            if not any(vals):
                continue
            diffs = [per["ulacache"].get(key, 0.0) - per[b].get(key, 0.0) for b in bases]
            lines.append(f"{label:<58}" + "".join(f"{v:>{w}.3f}" for v in vals)
                         + "".join(f"{d:>+{w}.3f}" for d in diffs))
    return lines


def _fmt_torch_ops(mode: str, plan: dict, runs: list[dict], top: int = 8) -> list[str]:
    """--torch-ops: per shape, the summed self CPU time of every torch op per decode step
    (median over repeats) for the baseline and ulacache, and the ops that differ most."""
    lines = []
    ok = [r for r in runs if not r.get("failed") and not r.get("duplicate_of")]
    for shape in plan["shapes"]:
        per = {}
        for n in (plan["baseline"], "ulacache"):
            rows = [r["shapes"][shape]["torch_ops"] for r in ok if r["config"] == n
                    and r["shapes"].get(shape, {}).get("torch_ops")]
            if rows:
                per[n] = rows
        if len(per) < 2:
            continue
        b, u = per[plan["baseline"]], per["ulacache"]
        med = lambda rows, op: statistics.median(x["ops_ms_per_step"].get(op, 0.0)  # noqa: E731
                                                 for x in rows)
        tb = statistics.median(x["total_ms_per_step"] for x in b)
        tu = statistics.median(x["total_ms_per_step"] for x in u)
        lines.append(f"\n-- {mode} / {shape}: torch ops, self CPU ms per decode step (after the "
                     f"first; median over repeats; profiler overhead included on both sides): "
                     f"{plan['baseline']} {tb:.3f}, ulacache {tu:.3f} ({tu - tb:+.3f}) --")
        ops = {op for x in b + u for op in x["ops_ms_per_step"]}
        diff = sorted(ops, key=lambda op: -abs(med(u, op) - med(b, op)))[:top]
        for op in diff:
            lines.append(f"  {op[:56]:<56} {med(b, op):9.3f} {med(u, op):9.3f} "
                         f"{med(u, op) - med(b, op):+9.3f}")
    return lines


def _fmt_summary(mode: str, plan: dict, summary: dict, runs: list[dict]) -> list[str]:
    lines = [f"\n== {mode}: {plan['description']} =="]
    for shape, s in summary.items():
        n, p, o = plan["shapes"][shape]
        lines.append(f"{shape} ({n} requests x {p} prompt tokens, {o} out): decode ms/step "
                     "(mean over the full-batch decode steps, median over repeats) " + ", ".join(
                         f"{k} {v:.2f} (block {s['block_size_by_config'].get(k)})"
                         for k, v in s["decode_ms_median_by_config"].items())
                     + (f"; best stock by median step: {s['best_stock']}"
                        if len(s["decode_ms_median_by_config"]) > 2 else ""))
        for label in ("vs_stock", "vs_best_stock"):
            v = s.get(label)
            if not v or not v.get("step_ratio"):
                continue
            if label == "vs_best_stock" and v["baseline"] == plan["baseline"]:
                continue
            sr, mr, wr = v["step_ratio"], v["step_ratio_median"], v["wall_ratio"]
            nr = v["step_ratio_min"]
            lines.append(f"  ulacache / {v['baseline']}: mean decode step {sr['median']:.3f} "
                         f"[{sr['min']:.3f}, {sr['max']:.3f}], median decode step "
                         f"{mr['median']:.3f} [{mr['min']:.3f}, {mr['max']:.3f}], fastest "
                         f"decode step {nr['median']:.3f} [{nr['min']:.3f}, {nr['max']:.3f}], wall "
                         f"{wr['median']:.3f} [{wr['min']:.3f}, {wr['max']:.3f}] "
                         f"(median [min, max] over {len(sr['values'])} pair(s))")
        by_cfg = s.get("vs_stock_by_config") or {}
        if len(by_cfg) > 1:
            lines.append(f"  every configuration / {plan['baseline']}, mean decode step: " + "; ".join(
                f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
                for k, v in by_cfg.items()))
        for rk, d in s.get("ulacache_store_ms_per_step", {}).items():
            if any(d.values()):
                lines.append(f"  ulacache store ms/step ({rk}, all steps): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in d.items()) + " (begin includes write and the "
                    "settle copies; read includes the resolve-side exchange)")
        for rk, d in s.get("ulacache_counters", {}).items():
            if d:
                lines.append(f"  ulacache counters ({rk}, timed run): " + ", ".join(
                    f"{k} {v:g}" for k, v in d.items()))
        dc = s.get("ulacache_counts_per_decode_step")
        if dc:
            lines.append("  ulacache counters per full-batch decode step (rank0): " + ", ".join(
                f"{k} {v:.1f}" for k, v in dc.items()) + (
                f"; device hit rate {dc['hits'] / dc['lookups']:.3f}" if dc.get("lookups")
                else "") + f"; rows moved {dc['promotions'] + dc['demotions']:.1f}")
        for k, reps in (s.get("spec_decode_by_config") or {}).items():
            lines.append(f"  speculative decoding, {k} (per repeat): " + "; ".join(
                f"{d.get('num_drafts', 0):g} drafts, {d.get('num_draft_tokens', 0):g} draft "
                f"tokens, {d.get('num_accepted_tokens', 0):g} accepted "
                f"(rate {d.get('acceptance', 0):.3f})" for d in reps))
        ov = s.get("indexer_overlap")
        if ov is not None or "overlap_run_tokens_identical" in s:
            ov = ov or {}
            lines.append(f"  model {plan.get('model_variant', 'random')}: indexer top-k "
                         "step-to-step overlap (untimed traced ulacache run) " + (
                             f"mean {ov['mean']:.3f}, median {ov['median']:.3f}, p10 "
                             f"{ov['p10']:.3f}, p90 {ov['p90']:.3f} ({ov['samples']} samples)"
                             if "mean" in ov else "not measured")
                         + "; traced run token-identical to stock: "
                         + ("yes" if s.get("overlap_run_tokens_identical") else "NO"))
        ti = s["tokens_identical"]
        lines.append("  outputs token-identical to stock: " + ", ".join(
            f"{k} {'yes' if v else 'NO'}" for k, v in ti.items() if k != plan["baseline"]))
    for r in runs:
        if r.get("failed"):
            last = (r.get("stderr_tail") or "").strip().splitlines()[-1:]
            lines.append(f"  FAILED {r['config']} repeat {r['repeat'] + 1}: {r['failed']}"
                         + (f": {last[0]}" if last else ""))
    return lines


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, med, lo, hi, wall, medstep, minstep = [], [], [], [], [], [], []
    for mode, m in doc["modes"].items():
        for shape, s in m["summary"].items():
            for label in ("vs_stock", "vs_best_stock"):
                v = s.get(label)
                if not v or not v.get("step_ratio"):
                    continue
                if label == "vs_best_stock" and v["baseline"] == m["plan"]["baseline"]:
                    continue
                sr = v["step_ratio"]
                tag = "" if label == "vs_stock" else f"\nvs {v['baseline']}"
                labels.append(f"{mode}\n{shape}{tag}" if len(m["summary"]) > 1 or tag
                              else mode)
                med.append(sr["median"])
                lo.append(sr["median"] - sr["min"])
                hi.append(sr["max"] - sr["median"])
                wall.append((v["wall_ratio"] or {}).get("median", float("nan")))
                medstep.append((v.get("step_ratio_median") or {}).get("median", float("nan")))
                minstep.append((v.get("step_ratio_min") or {}).get("median", float("nan")))
    profs = [(mode, shape, per) for mode, m in doc["modes"].items()
             for shape, per in (m.get("profile") or {}).items() if "ulacache" in per]
    nrows = 2 if profs else 1
    fig, axes = plt.subplots(nrows, 1, figsize=(max(10, 1.1 * len(labels)), 5 * nrows),
                             squeeze=False)
    ax = axes[0][0]
    x = range(len(labels))
    ax.bar(x, med, color="#2a7", yerr=[lo, hi], capsize=4,
           label="mean decode step: median over pairs, bars min-max")
    ax.plot(list(x), medstep, "o", color="#136", label="median decode step (median over pairs)")
    ax.plot(list(x), minstep, "^", color="#a50", label="fastest decode step (median over pairs)")
    ax.plot(list(x), wall, "kx", label="generate wall time (median over pairs)")
    ax.axhline(1.0, color="#555", lw=1)
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("ulacache / stock (log scale)")
    ax.set_title("equal batch: ulacache / stock per decode step" +
                 (" (LOADED shared machine: noise-dominated)" if doc.get("loaded_machine")
                  else ""))
    ax.legend(fontsize=8)
    if profs:
        ax2 = axes[1][0]
        keys = [k for k, _ in PHASE_ORDER]
        bars, names = [], []
        for mode, shape, per in profs:
            base = doc["modes"][mode]["plan"]["baseline"]
            best = doc["modes"][mode]["summary"].get(shape, {}).get("best_stock")
            for n in dict.fromkeys((base, best, "ulacache")):
                if n and n in per:
                    bars.append(per[n])
                    names.append(f"{mode}/{shape}: {n}")
        bottom = [0.0] * len(bars)
        colors = list(plt.get_cmap("tab20").colors) + list(plt.get_cmap("Dark2").colors)
        for i, k in enumerate(keys):
            vals = [b.get(k, 0.0) for b in bars]
            if not any(vals):
                continue
            ax2.bar(range(len(bars)), vals, bottom=bottom, color=colors[i % len(colors)], label=k)
            bottom = [a + b for a, b in zip(bottom, vals)]
        ax2.set_xticks(range(len(bars)), names, fontsize=6, rotation=40, ha="right")
        ax2.set_ylabel("ms per decode step")
        ax2.set_title("per-phase profile, ms per decode step (faster half of the steps)")
        ax2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def resummarize(path: Path) -> None:
    doc = json.loads(path.read_text())
    report = []
    for mode, m in doc["modes"].items():
        plan, runs = m["plan"], m["runs"]
        plan["shapes"] = {k: tuple(v) for k, v in plan["shapes"].items()}
        m["summary"] = summarize(plan, [r for r in runs if not r.get("duplicate_of")])
        if any(r.get("shapes", {}).get(s, {}).get("phases_ms_per_decode_step")
               for r in runs for s in plan["shapes"]):
            m["profile"] = profile_table(plan, runs)
            m["profile_all_steps"] = profile_table(plan, runs, "all")
        report += _fmt_summary(mode, plan, m["summary"], runs) + \
            _fmt_profile(mode, plan, m.get("profile") or {}, m["summary"])
    doc["report"] = report
    print("\n".join(report))
    path.write_text(json.dumps(doc, indent=1, default=str))
    plot(doc, path.with_suffix(".png"))
    print(f"rewrote {path} and {path.with_suffix('.png')}")


def _overlap_run(mode: str, plan: dict, args, stem: str) -> dict:
    """--indexer-overlap: one untimed ulacache run of the mode's batch with the selection trace
    on (no warm-up, so the trace holds exactly the batch's generate), the step-to-step top-k
    overlap per shape from it (lab/stable_indexer.py ``overlap_from_trace``)."""
    import tempfile

    c = plan["configs"]["ulacache"]
    with tempfile.TemporaryDirectory(prefix="eb_trace_") as d:
        cfg = {"name": f"{mode}/ulacache-trace", "backend": "ulacache", "model": plan["model"],
               "dtype": plan["dtype"],
               "llm_kw": dict(c["llm_kw"], disable_log_stats=not args.log_stats),
               "shapes": plan["shapes"], "profile": False, "torch_ops": False,
               "warmup": False, "trace_path": str(Path(d) / f"{stem}.jsonl"),
               "topk": plan["topk"]}
        bind, pin = _bind(1, args.bind)
        print(f"[{time.strftime('%H:%M:%S')}] {mode}: ulacache with the selection trace "
              f"(overlap, untimed) ...", flush=True)
        r = _spawn(cfg, bind, pin, args.timeout)
    if r.get("failed"):
        print(f"  FAILED: {r['failed']}\n{(r.get('stderr_tail') or '')[-2500:]}", flush=True)
        return {"failed": r["failed"]}
    out = {s: v.get("indexer_overlap") for s, v in r["shapes"].items()}
    out["tokens_sha256"] = {s: v["tokens_sha256"] for s, v in r["shapes"].items()}
    out["ulacache_counters"] = {s: (v.get("ulacache") or [{}])[0].get("totals")
                                for s, v in r["shapes"].items()}
    for s, ov in out.items():
        if isinstance(ov, dict) and "mean" in ov:
            print(f"  {s}: top-k overlap mean {ov['mean']:.3f} (median {ov['median']:.3f}, "
                  f"p10 {ov['p10']:.3f}, p90 {ov['p90']:.3f}; {ov['samples']} samples)",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    ap.add_argument("--repeats", type=int, default=None,
                    help="A B pairs per mode (default 3; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="small batches, fewer block sizes")
    ap.add_argument("--profile", action="store_true", help="per-phase profile (module doc)")
    ap.add_argument("--model", default=None, help="DSA model (default: embedded tiny V3.2)")
    ap.add_argument("--dsa-shape", type=int, nargs=3, metavar=("N", "L", "M"), default=None,
                    help="DSA batch of every DSA mode: requests, prompt tokens, output tokens "
                         f"(default {DSA_SHAPE['full']}, --quick {DSA_SHAPE['quick']}; "
                         f"dsa-pressure --quick {PRESSURE_SHAPE['quick']})")
    ap.add_argument("--arena-shapes", default=None, help="subset of short,long")
    ap.add_argument("--arena-out", type=int, default=None, metavar="M",
                    help="output tokens of every arena shape (default: the shape's own)")
    ap.add_argument("--block-sizes", default=None,
                    help=f"stock block sizes for arena modes (default {BLOCK_SIZES['full']}, "
                         f"--quick {BLOCK_SIZES['quick']})")
    ap.add_argument("--ula-block-sizes", default=None,
                    help="arena modes: also run ulacache with these attention page sizes "
                         "(`--block-size`; configs ulacache-bsN, reported against stock in "
                         "vs_stock_by_config)")
    ap.add_argument("--pressure-frac", type=float, default=1 / 3,
                    help="dsa-pressure: ulacache device pool / batch tokens")
    ap.add_argument("--tp2-device-frac", type=float, default=0.75,
                    help="dsa-tp2: ulacache device rows per rank / batch tokens")
    ap.add_argument("--spec", default=None, metavar="METHOD[:K]",
                    help="speculative decoding on both sides: mtp[:K] or ngram[:K] (module doc)")
    ap.add_argument("--torch-ops", action="store_true",
                    help="TP=1: torch.profiler self CPU time per op over the decode steps "
                         "after the first, per run; the summary compares ulacache's ops with "
                         "the baseline's (what the forward itself costs on each side)")
    ap.add_argument("--dsa-model-variant", default=None, metavar="stable:RHO[:PE]",
                    help="DSA modes: a variant of the DSA model whose indexer top-k repeats "
                         "from step to step (benchmarks/lab/stable_indexer.py: token "
                         "embeddings share a component of weight RHO, the indexer keys' RoPE "
                         "half scaled by PE, default 1); implies "
                         "--indexer-overlap (default: the model itself)")
    ap.add_argument("--indexer-overlap", action="store_true",
                    help="DSA modes at TP=1: after the pairs, one more ulacache run (no "
                         "warm-up, not timed) with its selection trace on, to measure the "
                         "indexer's step-to-step top-k overlap on the same batch (recorded "
                         "per mode as indexer_overlap)")
    ap.add_argument("--aa", action="store_true",
                    help="also run the baseline a second time in every repeat (config "
                         "BASELINE-aa, never deduplicated or taken as the best stock): the A/A "
                         "control, whose ratio to the baseline is this host's noise floor")
    ap.add_argument("--fixed-order", action="store_true",
                    help="run the configurations in the same order in every repeat (default: "
                         "the first repeat in plan order, then each later repeat rotated by "
                         "one, so no configuration always runs at the same position)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--bind", default="auto", help="TP=1: the CPU each engine is pinned to "
                    "(one OpenMP thread; default auto: the idlest CPU at the run's start); "
                    "TP=2: VLLM_CPU_OMP_THREADS_BIND 'a|b' (default: the first two CPUs)")
    ap.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True,
                    help="engine stats on (as `vllm serve`; default) or off (LLM's default)")
    ap.add_argument("--timeout", type=float, default=1200, help="per engine run, seconds")
    ap.add_argument("--out", default=str(RESULTS), help="directory for the JSON and the plot")
    ap.add_argument("--name", default=None, help="file stem (default equal_batch[_quick])")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="summarize, print and plot an earlier run's JSON again (no engines; "
                         "rewrites its summary, profile tables and PNG)")
    args = ap.parse_args()
    if args.from_json:
        return resummarize(Path(args.from_json))
    if args.worker:
        res = _worker(json.loads(args.worker))
        print(MARK + json.dumps(res), flush=True)
        return
    repeats = args.repeats or (2 if args.quick else 3)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; one of {MODES}")
    from _host import cpu_host

    load0 = os.getloadavg()
    doc = {"args": vars(args), "host": cpu_host(), "repeats": repeats,
           "loadavg_start": load0, "loaded_machine": load0[0] > 0.5 * (os.cpu_count() or 1),
           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "modes": {}}
    import vllm

    doc["vllm"] = {"version": vllm.__version__, "path": str(Path(vllm.__file__).parent)}
    stem = args.name or ("equal_batch_quick" if args.quick else "equal_batch")
    spec_cfg = _spec_config(args.spec or "")
    if spec_cfg and not args.name:
        stem += f"_spec_{spec_cfg['method']}"
    out = Path(args.out) / stem
    out.parent.mkdir(parents=True, exist_ok=True)
    report: list[str] = []
    for mode in modes:
        plan = plan_mode(mode, args)
        if args.aa:  # the A/A control runs right after the baseline in every repeat
            cfgs, base = plan["configs"], plan["baseline"]
            plan["configs"] = {}
            for n, c in cfgs.items():
                plan["configs"][n] = c
                if n == base:
                    plan["configs"][f"{base}-aa"] = dict(c, llm_kw=dict(c["llm_kw"]))
        runs: list[dict] = []
        spec = None
        skip: set[str] = set()
        for rep in range(repeats):
            order = list(plan["configs"].items())
            if not args.fixed_order and rep:  # each configuration at every position in turn
                order = order[rep % len(order):] + order[:rep % len(order)]
            for name, c in order:
                if name in skip:
                    continue
                if c.get("sized") and not c.get("sized_done"):
                    if spec is None or not spec.get("mla"):
                        runs.append({"config": name, "repeat": rep, "failed":
                                     f"no stock MLA spec to size from ({spec})"})
                        continue
                    _size_ula(plan, c, spec)
                tp = c.get("tp", 1)
                cfg = {"name": f"{mode}/{name}", "backend": c["backend"],
                       "model": plan["model"], "dtype": plan["dtype"],
                       "llm_kw": dict(c["llm_kw"], disable_log_stats=not args.log_stats,
                                      **({"speculative_config": spec_cfg} if spec_cfg else {})),
                       "shapes": plan["shapes"], "profile": args.profile,
                       "torch_ops": args.torch_ops and tp == 1,
                       "warmup": not args.no_warmup}
                bind, pin = _bind(tp, args.bind)
                print(f"[{time.strftime('%H:%M:%S')}] {mode} repeat {rep + 1}/{repeats}: "
                      f"{name} (CPU {bind}) ...", flush=True)
                r = _spawn(cfg, bind, pin, args.timeout)
                r.update(config=name, repeat=rep, loadavg=os.getloadavg())
                runs.append(r)
                if r.get("failed"):
                    print(f"  FAILED: {r['failed']}\n{(r.get('stderr_tail') or '')[-2500:]}",
                          flush=True)
                    continue
                print(f"  done in {r['process_s']:.0f} s (boot {r['boot_s']:.0f} s): " + ", ".join(
                    f"{s} decode {(v['decode_ms'] or {}).get('mean', float('nan')):.2f} ms/step, "
                    f"wall {v['wall_s']:.2f} s" for s, v in r["shapes"].items()), flush=True)
                if c["backend"] == "vllm" and name == plan["baseline"] and spec is None:
                    spec = r["spec_bytes"]
                if (rep == 0 and c["backend"] == "vllm" and name != plan["baseline"]
                        and not name.endswith("-aa")):
                    # a block size the engine overrode to one already run: not run again
                    seen = {x["engine_path"]["block_size"]: x["config"] for x in runs
                            if not x.get("failed") and x["config"] != name
                            and x.get("backend") == "vllm"}
                    bsz = r["engine_path"]["block_size"]
                    if bsz in seen:
                        r["duplicate_of"] = seen[bsz]
                        skip.add(name)
        summary = summarize(plan, [r for r in runs if not r.get("duplicate_of")])
        overlap = None
        if (mode.startswith("dsa-") and plan["tp"] == 1
                and (args.indexer_overlap or _variant_rho(args) is not None)):
            overlap = _overlap_run(mode, plan, args, stem)
            for shape, s in summary.items():
                s["indexer_overlap"] = overlap.get(shape)
                stock_h = s["tokens_sha256_by_config"].get(plan["baseline"]) or []
                s["overlap_run_tokens_identical"] = (
                    (overlap.get("tokens_sha256") or {}).get(shape) in stock_h)
        prof = profile_table(plan, runs) if args.profile else {}
        prof_all = profile_table(plan, runs, "all") if args.profile else {}
        doc["modes"][mode] = {"plan": {k: v for k, v in plan.items()},
                              "summary": summary, "profile": prof,
                              "profile_all_steps": prof_all, "runs": runs}
        if overlap is not None:
            doc["modes"][mode]["overlap_run"] = overlap
        lines = (_fmt_summary(mode, plan, summary, runs) + _fmt_profile(mode, plan, prof, summary)
                 + _fmt_torch_ops(mode, plan, runs))
        print("\n".join(lines), flush=True)
        report += lines
        doc["report"] = report
        doc["loadavg_end"] = os.getloadavg()
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    host = doc["host"]
    print(f"\nhost: {host['cpu']} ({host['cores']} cores), MLA path pinned: reference; "
          f"load average at start {load0[0]:.1f}, at end {doc['loadavg_end'][0]:.1f}"
          + (" (LOADED MACHINE: timings are noisy)" if doc["loaded_machine"] else ""))
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
