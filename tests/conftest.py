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


def pytest_runtest_setup(item):
    """Before any fixture of ``item`` (module-scoped ones included) runs: tell the engine
    helper whether this test may boot vLLM."""
    import _vllm_subprocess

    _vllm_subprocess.ENGINE_MARKED = item.get_closest_marker("engine") is not None


@pytest.fixture(scope="session")
def tiny_model() -> TinyModels:
    MODELS_CACHE.mkdir(parents=True, exist_ok=True)
    return TinyModels(MODELS_CACHE)
