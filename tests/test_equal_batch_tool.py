"""`benchmarks/equal_batch.py` runs end to end on its smallest configuration: one stock and one
ulacache engine on the same DSA batch (fast path), and its JSON carries both runs, their output
token hashes (equal: greedy decoding is token-exact under ulacache) and the ulacache / stock
ratio fields. No timing is asserted (speed lives in the benchmark, never in a timed test)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _vllm_subprocess import require_engine_marker, vllm_env

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.engine
def test_equal_batch_quick_dsa_fast(tmp_path):
    require_engine_marker()
    # The smallest batch that still reads past index_topk (16) tokens per request.
    cmd = [sys.executable, str(REPO / "benchmarks" / "equal_batch.py"), "--quick",
           "--modes", "dsa-fast", "--repeats", "1", "--dsa-shape", "2", "48", "4",
           "--no-warmup", "--out", str(tmp_path), "--name", "eb"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=vllm_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "eb.json").read_text())
    assert (tmp_path / "eb.png").exists()
    assert doc["host"]["cpu"] and doc["vllm"]["version"]
    mode = doc["modes"]["dsa-fast"]
    runs = {r["config"]: r for r in mode["runs"]}
    assert set(runs) == {"stock", "ulacache"}, mode["runs"]
    for name, backend in (("stock", "vllm"), ("ulacache", "ulacache")):
        r = runs[name]
        assert not r.get("failed"), r
        assert r["backend"] == backend
        assert r["engine_path"]["mla_path"] and r["engine_path"]["block_size"] == 16
        sh = r["shapes"]["batch"]
        assert sh["out_tokens"] == 2 * 4
        assert sh["decode_steps_full"] >= 1 and sh["decode_ms"]["mean"] > 0
        assert len(sh["tokens_sha256"]) == 64
    # Same requests, greedy: token-identical outputs.
    assert runs["stock"]["shapes"]["batch"]["tokens_sha256"] == \
        runs["ulacache"]["shapes"]["batch"]["tokens_sha256"]
    s = mode["summary"]["batch"]
    assert s["tokens_identical"]["ulacache"] is True
    ratio = s["vs_stock"]["step_ratio"]
    assert ratio["median"] > 0 and len(ratio["values"]) == 1
    assert s["vs_stock"]["wall_ratio"]["median"] > 0
    # ulacache's store reported its time breakdown and stayed on the fast path.
    u = runs["ulacache"]["shapes"]["batch"]["ulacache"][0]
    assert set(u["time_ms"]) >= {"write", "read", "copy", "begin", "exchange"}
    assert u["identity_mode_end"] is True and u["totals"]["demotions"] == 0
