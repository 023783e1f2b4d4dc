"""DP mode: `vllm serve ... --kv-backend ulacache --data-parallel-size 2`. Each DP rank runs
its own engine core with its own pools; `/metrics` carries ulacache series per engine.

The model is the tiny DeepSeek-V3.2 with dense MLPs only: vLLM's CPU build cannot run MoE
layers under DP (stock vLLM fails the same way), and the MLP is irrelevant to the KV path.
"""
from __future__ import annotations

import re
import time

import pytest
import requests

from test_serve import concurrent_greedy, serve

pytestmark = pytest.mark.engine  # every test here boots vLLM


def _per_engine(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}{{([^}}]*)}} ([0-9.eE+-]+)$", text, re.M):
        eng = re.search(r'engine="([^"]+)"', m.group(1))
        if eng:
            out[eng.group(1)] = out.get(eng.group(1), 0.0) + float(m.group(2))
    return out


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    model = tiny_model("deepseek_v32", first_k_dense_replace=2)  # both layers dense MLP
    log = tmp_path_factory.mktemp("serve_dp") / "serve.log"
    with serve(model, log, ["--data-parallel-size", "2"], timeout=400) as base:
        yield base, str(model), log


def test_dp_ranks_serve_and_report_their_own_pools(dp_server):
    base, model, log = dp_server
    concurrent_greedy(base, model, n=16, growth=8)  # spread over both ranks
    time.sleep(3)
    text = requests.get(base + "/metrics", timeout=10).text
    cap = _per_engine(text, "vllm:ulacache_device_capacity")
    assert set(cap) == {"0", "1"} and all(v > 0 for v in cap.values()), text[-3000:]
    look = _per_engine(text, "vllm:ulacache_lookups_total")
    # Requests were spread over both ranks, and each rank's store counted its own lookups.
    assert set(look) == {"0", "1"} and all(v > 0 for v in look.values()), look
    assert log.read_text().count("ulacache KV:") >= 2  # one startup summary per rank
