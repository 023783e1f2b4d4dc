"""Shared pytest fixtures.

``tiny_model(name, **overrides) -> Path`` builds (once per session, cached on disk under the
git-ignored ``models_cache/tests/``) the tiny random-weight models of
``ulacache_vllm.models``. A cached directory is reused only if it was built by the same
factory source, name, seed and overrides (the key is hashed into the directory name).
Directories built by an older factory source are deleted once they are an hour old (young
ones may belong to a concurrent session still running the old source).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/_vllm_subprocess.py
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # the lab: baselines the tests compare with
MODELS_CACHE = Path(os.environ.get("ULACACHE_MODELS_CACHE", REPO_ROOT / "models_cache" / "tests"))


def _factory_fingerprint() -> str:
    """Hash of the factory's source: edits to it invalidate cached models."""
    import ulacache_vllm.models as m

    h = hashlib.sha256()
    for f in sorted(Path(m.__file__).parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


class TinyModels:
    """Builds and caches tiny models; ``__call__(name, seed=0, weights_from=None, **overrides)``."""

    def __init__(self, root: Path):
        self.root = root
        self.fingerprint = _factory_fingerprint()
        self._prune_stale()

    def _prune_stale(self, max_age_s: float = 3600) -> None:
        for d in self.root.iterdir():
            if d.is_dir() and f"-{self.fingerprint}-" not in d.name \
                    and time.time() - d.stat().st_mtime > max_age_s:
                shutil.rmtree(d, ignore_errors=True)

    def __call__(self, name: str, *, seed: int = 0, weights_from: Path | None = None,
                 **overrides) -> Path:
        from ulacache_vllm.models import build_model
        from ulacache_vllm.models.factory import BUILD_INFO

        key = json.dumps([self.fingerprint, name, seed, overrides,
                          str(weights_from) if weights_from else None], sort_keys=True)
        digest = hashlib.sha256(key.encode()).hexdigest()[:10]
        out = self.root / f"{name}-{self.fingerprint}-{digest}"
        if not (out / BUILD_INFO).exists():
            build_model(name, out, overrides=overrides or None, seed=seed,
                        weights_from=weights_from)
        return out

    def dense_twin(self, dsa_model: Path) -> Path:
        """DeepSeek-V3 dense-MLA model with ``dsa_model``'s weights (indexer dropped)."""
        return self("deepseek_v3", weights_from=dsa_model)


# Process-environment flags that only some test modules may set, and only inside a block or
# fixture that puts the previous value back (engine, server and lm-eval subprocesses inherit
# this process's environment): a module that sets one at import leaks it to every test
# collected or run after it. TRITON_INTERPRET: tests/core/_triton_interpreter.py.
SCOPED_ENV_FLAGS = ("TRITON_INTERPRET",)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """Importing a test module (collecting it) must leave ``SCOPED_ENV_FLAGS`` as they were:
    otherwise the module's collection fails, naming the flag, and the flag is put back."""
    if not isinstance(collector, pytest.Module):
        yield
        return
    before = {k: os.environ.get(k) for k in SCOPED_ENV_FLAGS}
    outcome = yield
    changed = [k for k, v in before.items() if os.environ.get(k) != v]
    for k in changed:
        if before[k] is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = before[k]
    if changed:
        report = outcome.get_result()
        report.outcome = "failed"
        report.result = []
        report.longrepr = (
            f"{collector.nodeid} changed {', '.join(changed)} in the process environment at "
            f"import; every later test and every engine, server or lm-eval subprocess would "
            f"inherit it. Set it only inside a block that restores it (e.g. "
            f"tests/core/_triton_interpreter.py's interpreted()).")


# The process environment every test starts with. vLLM's CPU platform hook edits os.environ
# whenever a test builds an engine config in this process (LD_PRELOAD of torch's libgomp,
# NUMEXPR_MAX_THREADS, VLLM_WORKER_MULTIPROC_METHOD, LOCAL_WORLD_SIZE, ...): left there, every
# later engine, server or lm-eval subprocess would inherit them (an LD_PRELOAD at its start),
# differently with the order tests run in, and none could be forked from the pre-imported
# interpreter. Put back after each module's last test, once its module-scoped fixtures are
# torn down (a module may scope a flag to itself: tests/core/_triton_interpreter.py), pytest's
# own PYTEST_CURRENT_TEST aside.
SESSION_ENV = dict(os.environ)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    for k in [k for k in os.environ if k not in SESSION_ENV and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[k]
    for k, v in SESSION_ENV.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


def pytest_runtest_setup(item):
    """Before any fixture of ``item`` (module-scoped ones included) runs: tell the engine
    helper whether this test may boot vLLM."""
    import _vllm_subprocess

    _vllm_subprocess.ENGINE_MARKED = item.get_closest_marker("engine") is not None


@pytest.fixture(scope="session")
def tiny_model() -> TinyModels:
    MODELS_CACHE.mkdir(parents=True, exist_ok=True)
    return TinyModels(MODELS_CACHE)


def pytest_collection_finish(session):
    """With engine tests selected: start the pre-imported interpreter that forks their scripts
    (``tests/_vllm_zygote.py``) now, so its vLLM import overlaps the tests before them."""
    if not session.config.option.collectonly and any(
            item.get_closest_marker("engine") for item in session.items):
        import _vllm_subprocess

        _vllm_subprocess.start_zygote(SESSION_ENV)


def pytest_terminal_summary(terminalreporter):
    import _vllm_subprocess

    n = _vllm_subprocess.SCRIPTS
    if n["forked"] or n["fresh"]:
        terminalreporter.write_line(
            f"vLLM scripts: {n['forked']} forked from the pre-imported interpreter, "
            f"{n['fresh']} in fresh interpreters (for: "
            f"{', '.join(f'{k} x{c}' for k, c in n['fresh_keys'].most_common()) or '-'})")
