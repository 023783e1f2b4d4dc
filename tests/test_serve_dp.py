"""DP mode: `vllm serve ... --kv-backend ulacache --data-parallel-size 2`. Each DP rank runs
its own engine core with its own pools; `/metrics` carries ulacache series per engine.

The model is the tiny DeepSeek-V3.2 with dense MLPs only: vLLM's CPU build cannot run MoE
layers under DP (stock vLLM fails the same way), and the MLP is irrelevant to the KV path.

The reference is a single-rank stock server of the same model, booted side by side with the
DP server: a request's greedy text does not depend on which rank serves it or on DP (each
rank is a whole float32 engine; checked once by hand: a stock DP=2 server gives the
single-rank stock server's text for every prompt of the workload below), and a stock DP=2
server would cost two more engine cores.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import requests

from test_serve import (HOLDABLE_ARGS, HOLDABLE_ENV, _assert_texts_equal, _both, _metric, _moved,
                        _pools_back_to_zero, _start, _stop, _wait_healthy, concurrent_greedy)

pytestmark = pytest.mark.engine  # every test here boots vLLM


def _per_engine(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} ([0-9.eE+-]+)$", text, re.M):
        eng = re.search(r'engine="([^"]+)"', m.group(1))
        if eng:
            out[eng.group(1)] = out.get(eng.group(1), 0.0) + float(m.group(2))
    return out


@pytest.fixture(scope="module")
def all_servers(tiny_model, tmp_path_factory):
    """The module's two servers, booted at the same time (their start-up overlaps; both tests
    need both): a ulacache DP=2 server with vLLM's prefix caching on (the reference path's
    flags turn it off; the later flag wins) and a stock single-rank server. One DP server
    serves both tests (suite time: each DP server is two engine cores). Yields {"ula",
    "stock"}: (base URL, model, log). At the end every server is sent SIGTERM before any is
    waited for, so their shutdowns overlap too."""
    model = tiny_model("deepseek_v32", first_k_dense_replace=2)  # both layers dense MLP
    d = tmp_path_factory.mktemp("serve_dp")
    specs = {
        "ula": dict(model=model, log=d / "serve.log", env_extra=HOLDABLE_ENV,
                    extra_args=["--data-parallel-size", "2", "--enable-prefix-caching",
                                *HOLDABLE_ARGS]),
        "stock": dict(model=model, log=d / "stock.log", extra_args=[], backend="vllm"),
    }
    procs = {}
    try:
        for name, spec in specs.items():
            procs[name] = _start(**spec)
        deadline = time.time() + 400
        for name, (proc, base) in procs.items():
            _wait_healthy(proc, base, specs[name]["log"], deadline)
        yield {name: (base, str(model), specs[name]["log"]) for name, (_, base) in procs.items()}
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in procs.values():
            _stop(proc)


def _reset_prefix_caches(base, timeout: float = 60) -> None:
    """vLLM's dev endpoint resets every rank's prefix cache (retried while blocks are held)."""
    deadline = time.time() + timeout
    while not requests.post(base + "/reset_prefix_cache", timeout=30).json()["success"]:
        assert time.time() < deadline, "reset_prefix_cache kept failing"
        time.sleep(1)


@pytest.fixture(scope="module")
def dp_servers(all_servers):
    """(ulacache DP=2 server: base URL, model, log), stock single-rank server's base URL."""
    return all_servers["ula"], all_servers["stock"][0]


def test_dp_ranks_equal_stock_and_move_their_own_tiers(dp_servers):
    """Sixteen concurrent greedy completions spread over both ranks, more than either rank's
    pools hold: every text is the stock server's, and each rank's own counters show rows
    demoted to its host pool and promoted back (its own lookups, capacity, startup line)."""
    (base, model, log), stock = dp_servers
    before = requests.get(base + "/metrics", timeout=10).text
    concurrent_greedy(base, model, n=16, growth=8, stock=stock, log=log)
    # Prefix caching is on: the finished requests' blocks stay cached with their rows until
    # the cache is reset (on every rank).
    _reset_prefix_caches(base)
    text = _pools_back_to_zero(base)
    cap = _per_engine(text, "vllm:ulacache_device_capacity")
    assert set(cap) == {"0", "1"} and all(v > 0 for v in cap.values()), text[-3000:]
    moved = {}
    for k in ("lookups", "demotions", "promotions"):
        b, a = (_per_engine(t, f"vllm:ulacache_{k}_total") for t in (before, text))
        moved[k] = {e: a[e] - b.get(e, 0.0) for e in a}
    # Requests were spread over both ranks, and each rank's store counted its own lookups
    # and spilled rows to its own host pool and back.
    for k, per in moved.items():
        assert set(per) == {"0", "1"} and all(v > 0 for v in per.values()), (k, moved)
    assert _moved(before, text)["demotions"] == sum(moved["demotions"].values())
    assert log.read_text().count("ulacache KV:") >= 2  # one startup summary per rank


@pytest.fixture(scope="module")
def dp_prefix_server(all_servers):
    """The ulacache DP=2 server (vLLM's prefix caching on): base URL, model, log."""
    return all_servers["ula"]


def _shared_prefix_waves() -> list[list[str]]:
    """Three waves of eight: two long shared prefixes with four tails each, then eight long
    unrelated prompts that outgrow a rank's device pool (the idle cached prefix blocks are
    demoted first), then the two prefixes again with other tails: their cached blocks are
    hit on whichever rank holds them, with rows in either tier."""
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    prefixes = [" ".join(words[(p + j * (p + 5)) % len(words)] for j in range(200 + 50 * p))
                for p in range(2)]

    def tails(w):
        return [prefixes[p] + " " + " ".join(words[(w * 7 + t * 3 + j) % len(words)]
                                             for j in range(6 + t))
                for p in range(2) for t in range(4)]
    flush = [f"{words[i]} {words[(i + 4) % 12]} " +
             " ".join(words[(i * 5 + j * (i + 7)) % len(words)] for j in range(280))
             for i in range(8)]
    return [tails(0), flush, tails(1)]


def test_dp_prefix_caching_hits_across_tiers_and_equals_stock(dp_prefix_server, dp_servers):
    """DP=2 with prefix caching on: every text of the three waves is the stock server's (its
    prefix caching off: the texts must not depend on where the KV came from), the ranks'
    prefix caches hit (vLLM's hit counter and the worker's count of
    taken-over entries), some hit entries sat in a host pool, and rows were demoted and
    promoted while the cached blocks were held."""
    base, model, log = dp_prefix_server
    _, stock = dp_servers
    before = requests.get(base + "/metrics", timeout=10).text
    for wave in _shared_prefix_waves():
        outs, ref = _both(base, stock, model, wave, 24, log)
        _assert_texts_equal(outs, ref)
    after = requests.get(base + "/metrics", timeout=10).text
    grew = {k: _metric(after, k) - _metric(before, k) for k in (
        "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
        "vllm:ulacache_prefix_hit_entries_total", "vllm:ulacache_prefix_hit_entries_host_total",
        "vllm:ulacache_demotions_total", "vllm:ulacache_promotions_total")}
    assert grew["vllm:prefix_cache_hits_total"] > 0, grew
    # Hit entries the workers took over, some of whose rows had been demoted to a host pool.
    assert grew["vllm:ulacache_prefix_hit_entries_total"] > \
        grew["vllm:ulacache_prefix_hit_entries_host_total"] > 0, grew
    assert grew["vllm:ulacache_demotions_total"] > 0 and grew["vllm:ulacache_promotions_total"] > 0, grew
    # Each rank keeps its own cache and its own pools: both served queries.
    queries = _per_engine(after, "vllm:prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries
