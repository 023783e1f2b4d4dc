"""scripts/cuda_e2e_check.py without a GPU: --help, the run plan (stock then ulacache for each
{bf16, fp8} x {eager, piecewise}, ulacache under pressure with the opt-in), the pass/fail
judgement, the tiny model's CUDA-legal shape, and a clear refusal (exit 2) where CUDA is missing.
No engine boots here."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cuda_e2e_check.py"


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("cuda_e2e_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_runs_and_says_what_a_pass_looks_like():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--plan" in proc.stdout and "Pass:" in proc.stdout


def test_plan_pairs_stock_and_ulacache_under_pressure(e2e):
    plan = e2e.build_plan(e2e.parse_args([]))
    assert [r["name"] for r in plan] == [
        f"{d}/{g}/{b}" for d in ("bf16", "fp8") for g in ("eager", "piecewise")
        for b in ("vllm", "ulacache")]
    for stock, ula in zip(plan[::2], plan[1::2]):
        assert stock["config"] == ula["config"]
        sk, uk = stock["engine_kwargs"], ula["engine_kwargs"]
        assert sk["kv_backend"] == "vllm" and uk["kv_backend"] == "ulacache"
        assert ula["env"][e2e.OPT_IN_ENV] == "1" and e2e.OPT_IN_ENV not in stock["env"]
        assert uk["kv_cache_memory_bytes"] < sk["kv_cache_memory_bytes"]  # pressure
        assert uk["ula_host_pool_gib"] > 0
        assert sk["kv_cache_dtype"] == uk["kv_cache_dtype"]
        assert sk["block_size"] == uk["block_size"] == 64
        # Same schedule on both sides, except the KV budget.
        rest = lambda k: {x: v for x, v in k.items()  # noqa: E731
                          if x not in ("kv_backend", "kv_cache_memory_bytes",
                                       "ula_host_pool_gib")}
        assert rest(sk) == rest(uk)
    bf16_eager = plan[1]["engine_kwargs"]
    assert bf16_eager["kv_cache_dtype"] == "auto" and bf16_eager["enforce_eager"] is True
    pw = plan[3]["engine_kwargs"]["compilation_config"]
    assert pw["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert plan[5]["engine_kwargs"]["kv_cache_dtype"] == "fp8"


def test_plan_subsets_and_bad_choices(e2e):
    plan = e2e.build_plan(e2e.parse_args(["--dtypes", "fp8", "--graphs", "eager"]))
    assert [r["name"] for r in plan] == ["fp8/eager/vllm", "fp8/eager/ulacache"]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--dtypes", "nvfp4"])
    proc = subprocess.run([sys.executable, str(SCRIPT), "--plan", "--graphs", "eager"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)) == 4


def test_cuda_legal_shape(e2e):
    s = e2e.CUDA_SHAPE
    assert s["kv_lora_rank"] + s["qk_rope_head_dim"] == 576
    assert s["index_topk"] % 128 == 0 and s["index_topk"] == 128


def test_judgement_fails_on_parity_or_missing_pressure(e2e):
    stock = {"name": "bf16/eager/vllm", "tokens": [[1, 2], [3, 4]], "tpot_s": 0.01,
             "sweep_tok_s": {"1": 100.0}}
    ula = {"name": "bf16/eager/ulacache", "tokens": [[1, 2], [3, 4]], "tpot_s": 0.012,
           "sweep_tok_s": {"1": 80.0},
           "usage": {"promotions": 5, "demotions": 7, "staged": 9, "overflow": 0}}
    r = e2e.compare(stock, ula)
    assert r["pass"] and r["parity"] and r["prompts_equal"] == "2/2"
    assert abs(r["tpot_ratio"] - 1.2) < 1e-9 and abs(r["sweep_ratio"]["1"] - 0.8) < 1e-9
    bad = dict(ula, tokens=[[1, 2], [3, 5]])
    assert not e2e.compare(stock, bad)["pass"]
    idle = dict(ula, usage={"promotions": 0, "demotions": 0})
    assert not e2e.compare(stock, idle)["pass"]  # no pressure: not a pass
    assert not e2e.compare(stock, {"name": ula["name"], "error": "boom"})["pass"]


def test_refuses_clearly_without_cuda(e2e, capsys):
    assert e2e.machine_problem() is not None
    assert e2e.main([]) == 2
    err = capsys.readouterr().err
    assert "cannot run here" in err and ("CUDA" in err or "GPU" in err)


def test_tiny_model_builds_with_the_cuda_shape(e2e, tmp_path):
    from ulacache_vllm.models import build_model

    out = build_model("deepseek_v32", tmp_path / "m", overrides=e2e.CUDA_SHAPE)
    cfg = json.loads((out / "config.json").read_text())
    for k, v in e2e.CUDA_SHAPE.items():
        assert cfg[k] == v, k
