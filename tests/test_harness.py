"""The test harness itself: engine subprocesses get a clean environment (and test-process flags
such as TRITON_INTERPRET never reach them), and a test that boots vLLM without the ``engine``
marker is refused (so ``pytest -m "not engine"`` boots none)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import _vllm_subprocess as vs


def test_engine_env_drops_test_process_flags(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = vs.vllm_env()
    assert "TRITON_INTERPRET" not in env and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert os.environ["TRITON_INTERPRET"] == "1"  # the test process keeps its own


# Runs pytest in a fresh interpreter whose environment has no TRITON_INTERPRET: the two Triton
# kernel-test modules (collected, and a kernel run through the interpreter), then an ordinary
# core test. Records the variable after collection, during each test and after the session,
# and what a subprocess started afterwards with a copy of os.environ inherits (as the serve,
# e2e and lm-eval launchers would without their own clean-up).
_PROBE = r"""
import json, os, subprocess, sys
import pytest

seen = {"during": {}}

class Probe:
    def pytest_collection_finish(self, session):
        seen["after_collection"] = os.environ.get("TRITON_INTERPRET")
    def pytest_runtest_call(self, item):
        seen["during"][item.name] = os.environ.get("TRITON_INTERPRET")

seen["rc"] = int(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Probe()]))
seen["after_session"] = os.environ.get("TRITON_INTERPRET")
seen["child"] = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
    capture_output=True, text=True, env=dict(os.environ)).stdout.strip()
print("@@PROBE@@" + json.dumps(seen))
"""


def test_kernel_tests_keep_triton_interpret_to_themselves():
    """The kernel tests run interpreted, and TRITON_INTERPRET is set only while they import
    their kernels and while they run: not after their collection, not in later tests, not in
    subprocesses started later by the same pytest process."""
    nodes = ["tests/core/test_kernels.py::test_kernels_really_interpreted",
             "tests/core/test_queue_kernels.py::test_queue_kernels_really_interpreted",
             "tests/core/test_queue_kernels.py::test_expand_first_k_one_strided_word",
             "tests/core/test_trace.py::test_loader_rejects_foreign_files"]
    proc = subprocess.run([sys.executable, "-c", _PROBE, *nodes], capture_output=True,
                          text=True, timeout=600, cwd=vs.REPO_ROOT, env=vs.vllm_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@PROBE@@")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(lines[-1][len("@@PROBE@@"):])
    assert seen["rc"] == 0, proc.stdout[-3000:]  # collected, and the kernels ran interpreted
    assert seen["after_collection"] is None, seen
    assert seen["during"] == {"test_kernels_really_interpreted": "1",
                              "test_queue_kernels_really_interpreted": "1",
                              "test_expand_first_k_one_strided_word": "1",
                              "test_loader_rejects_foreign_files": None}, seen
    assert seen["after_session"] is None and seen["child"] == "None", seen


def test_unmarked_test_cannot_boot_an_engine():
    assert vs.ENGINE_MARKED is False
    with pytest.raises(AssertionError, match="mark it @pytest.mark.engine"):
        vs.run_vllm_script("emit(1)")


@pytest.mark.engine
def test_marked_test_may_run_a_script():
    assert vs.ENGINE_MARKED is True
    assert vs.run_vllm_script("emit(ARGS['x'] + 1)", args={"x": 41}) == 42


_LEAKING_MODULE = """
import os
def test_edits_the_environment():  # as vLLM's platform hook does for an in-process config
    os.environ["ULACACHE_TEST_LEAKED"] = "1"
    os.environ["PATH"] += os.pathsep + "/nonexistent-by-a-test"
def test_still_sees_it_in_its_module():
    assert os.environ["ULACACHE_TEST_LEAKED"] == "1"
"""
_NEXT_MODULE = """
import os
def test_starts_with_the_session_environment():
    assert "ULACACHE_TEST_LEAKED" not in os.environ
    assert "/nonexistent-by-a-test" not in os.environ["PATH"]
"""


def test_a_module_that_edits_the_environment_leaves_it_to_itself(tmp_path):
    """conftest puts the session's environment back after each module: what a module's tests
    left in os.environ (vLLM's platform hook edits it when a test builds an engine config in
    the test process) reaches neither later modules nor the engine subprocesses they start."""
    (tmp_path / "test_a_leaks.py").write_text(_LEAKING_MODULE)
    (tmp_path / "test_b_next.py").write_text(_NEXT_MODULE)
    env = dict(vs.vllm_env(), PYTHONPATH=os.pathsep.join(
        [str(vs.REPO_ROOT / "tests"), vs.vllm_env().get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p",
                           "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
