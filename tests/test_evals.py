"""lm-eval's `vllm` model works on this build with `kv_backend=ulacache`, and scores and
greedy generations match the stock backend (few-shot prompts of several hundred tokens under
a small ulacache budget, so rows spill to the host pool)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _vllm_subprocess import mla_path_kwargs

pytestmark = pytest.mark.engine  # every test here boots vLLM (stock and ulacache, through lm-eval)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))

# Both engines of a comparison (stock and ulacache) run the reference MLA path's schedule on
# every host: block 16, chunked prefill and prefix caching off, 2048-token steps (lm-eval's
# max_model_len is 1024), the schedule these budgets and comparisons were verified with. On a
# host with AMX tiles vLLM would otherwise give this DSA model block 128, chunked prefill with
# a 4096-token default step (which ulacache lowers to what its device pool holds) and prefix
# caching.
PINNED_ARGS = ",".join(f"{k}={v}" for k, v in mla_path_kwargs("reference", 1024).items())

# The comparisons (``consistency.compare`` keyword arguments), by the test that reads each;
# those with the same engine arguments run on one engine per backend (``reports``).
COMPARISONS = {
    # 8 four-shot prompts of ~340 tokens outgrow the ~2k device slots this budget leaves.
    "test_lm_eval_consistency_ulacache_vs_stock": dict(
        limit=8, task="ulacache_arith", num_fewshot=4,
        ula_args=f"{PINNED_ARGS},ula_host_pool_gib=0.006,kv_cache_memory_bytes=10500000",
        ref_args=f"{PINNED_ARGS},kv_cache_memory_bytes=268435456"),
    # Multi-LexSum-shaped summarization: six zero-shot prompts need ~5k rows against ~2k
    # device slots.
    "test_lm_eval_long_document_summaries_match_through_the_host_tier": dict(
        limit=6, task="lexsum",
        ula_args=f"{PINNED_ARGS},ula_host_pool_gib=0.006,kv_cache_memory_bytes=10500000",
        ref_args=f"{PINNED_ARGS},kv_cache_memory_bytes=268435456"),
}


@pytest.fixture(scope="module")
def reports(request, tiny_model):
    """{test name: its comparison's report} for the comparisons the session selected, run
    together: one lm-eval process per backend evaluates every selected task in turn on one
    engine (both comparisons here have the same engine arguments, the reference MLA path's
    schedule and the same budgets), and the stock and ulacache processes run side by side
    (``side_by_side_binds``: each engine's compute threads on CPUs of their own, the same number
    of threads on both sides, each engine core in its lm-eval process; one after the other on a
    single CPU). A process is almost all
    start-up and shutdown (imports, engine boot, task building: ~50 s against seconds of
    generation), so one process per backend for both tasks, the two at once, costs about what
    one process did. Greedy decoding does not depend on timing or on the tasks evaluated before
    on the same engine (no prefix caching), and the ulacache process reads the tier counters
    around each task, so each report's counters are its own task's. An error is raised by every
    test that reads a report."""
    from _vllm_subprocess import side_by_side_binds
    from consistency import compare_tasks

    model = str(tiny_model("deepseek_v32"))
    selected = {item.originalname for item in request.session.items}
    names = [n for n in COMPARISONS if n in selected]
    # ``compare_tasks`` starts each lm-eval process with a copy of this process's environment:
    # test-process flags must not reach those engines (see _vllm_subprocess.vllm_env).
    env = pytest.MonkeyPatch()
    env.delenv("TRITON_INTERPRET", raising=False)
    groups: dict[tuple[str, str], list[str]] = {}
    for n in names:
        c = COMPARISONS[n]
        groups.setdefault((c["ula_args"], c["ref_args"]), []).append(n)
    out: dict[str, object] = {}
    try:
        for (ula_args, ref_args), group in groups.items():
            tasks = [{k: COMPARISONS[n].get(k) for k in ("task", "limit", "num_fewshot")}
                     for n in group]
            try:
                reps = compare_tasks(model, tasks, ula_args=ula_args, ref_args=ref_args,
                                     side_by_side=side_by_side_binds(2, in_process=True))
            except Exception as e:  # noqa: BLE001 - raised by each test that reads it
                reps = [e] * len(group)
            out.update(zip(group, reps))
        yield out
    finally:
        env.undo()


def _report(reports, name):
    rep = reports[name]
    if isinstance(rep, Exception):
        raise rep
    return rep


def test_lm_eval_consistency_ulacache_vs_stock(reports):
    rep = _report(reports, "test_lm_eval_consistency_ulacache_vs_stock")
    # Random weights may stop a generation at once ("\n\n"), but most are real text.
    assert rep["num_docs"] == 8 and rep["nonempty_generations"] >= 4
    assert rep["stock"]["sample_len"] == rep["ulacache"]["sample_len"] == 8
    # The comparison covered the tiered path: rows went to the host and came back.
    assert rep["host_tier_used"], rep["ulacache_tiers"]
    assert rep["ulacache_tiers"]["demotions"] > 0 and rep["ulacache_tiers"]["promotions"] > 0
    assert rep["scores_equal"], rep
    assert rep["generations_identical"], rep


def test_lm_eval_long_document_summaries_match_through_the_host_tier(reports):
    """Multi-LexSum-shaped summarization (self-written ~800-token cases, ROUGE through a
    task function): six zero-shot prompts need ~5k rows against ~2k device slots."""
    rep = _report(reports, "test_lm_eval_long_document_summaries_match_through_the_host_tier")
    assert rep["task"] in ("ulacache_lexsum", "multi_lexsum") and rep["num_fewshot"] == 0
    assert rep["num_docs"] == 6 and rep["nonempty_generations"] >= 3
    assert {"rouge1,none", "rougeL,none"} <= set(rep["stock"])
    assert rep["ulacache_tiers"]["demotions"] > 0 and rep["ulacache_tiers"]["promotions"] > 0
    assert rep["scores_equal"], rep
    assert rep["generations_identical"], rep
