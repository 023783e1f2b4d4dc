"""The test harness itself: engine subprocesses get a clean environment, and a test that boots
vLLM without the ``engine`` marker is refused (so ``pytest -m "not engine"`` boots none)."""
from __future__ import annotations

import os

import pytest

import _vllm_subprocess as vs


def test_engine_env_drops_test_process_flags(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = vs.vllm_env()
    assert "TRITON_INTERPRET" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert os.environ["TRITON_INTERPRET"] == "1"  # the test process keeps its own


def test_unmarked_test_cannot_boot_an_engine():
    assert vs.ENGINE_MARKED is False
    with pytest.raises(AssertionError, match="mark it @pytest.mark.engine"):
        vs.run_vllm_script("emit(1)")


@pytest.mark.engine
def test_marked_test_may_run_a_script():
    assert vs.ENGINE_MARKED is True
    assert vs.run_vllm_script("emit(ARGS['x'] + 1)", args={"x": 41}) == 42
