"""Command-line tools beside the engine: quick benchmark runs keep the committed full-sweep
results, and fixture generators honour --help."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_pblru_quick_and_trace_runs_write_their_own_files(tmp_path):
    small = ["--batches", "8", "--fracs", "0.5", "--steps", "6", "--topk", "32", "--repeats", "1"]
    r = _run("benchmarks/pblru_vs_lru.py", "--quick", *small, "--out", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pblru_vs_lru_quick.json",
                                                           "pblru_vs_lru_quick.png"]
    import json

    host = json.loads((tmp_path / "pblru_vs_lru_quick.json").read_text())["host"]
    assert host["mla_path"] in ("amx", "reference") and isinstance(host["amx_tile"], bool)
    from lab.trace import generate_dsa_trace, save_trace

    trace = tmp_path / "t.npz"
    save_trace(generate_dsa_trace(num_steps=6, batch=4, topk=16, prompt_len=(16, 32),
                                  decode_len=(2, 4)), str(trace))
    out = tmp_path / "trace_out"
    r = _run("benchmarks/pblru_vs_lru.py", "--trace", trace, "--repeats", "1", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["pblru_vs_lru_trace.json",
                                                      "pblru_vs_lru_trace.png"]


def test_lexsum_fixture_generator_help_writes_nothing(tmp_path):
    target = tmp_path / "cases.jsonl"
    r = _run("evals/fixtures/make_lexsum_cases.py", "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower()
    assert "wrote" not in r.stdout
    r = _run("evals/fixtures/make_lexsum_cases.py", "--out", target)
    assert r.returncode == 0, r.stderr
    # Deterministic: it regenerates the committed fixture byte for byte.
    assert target.read_bytes() == (ROOT / "evals" / "fixtures" / "lexsum_cases.jsonl").read_bytes()
