"""Tiny-model factory: deterministic random-weight HF checkpoints for tests and the default.

``build_model(name, outdir, overrides=None, seed=0, weights_from=None)``; ``MODEL_NAMES``
lists the families; CLI: ``python -m ulacache_vllm.models {list,build NAME OUTDIR}``.
"""

from .configs import FAMILIES, MODEL_NAMES
from .factory import build_dense_twin, build_model

__all__ = ["FAMILIES", "MODEL_NAMES", "build_dense_twin", "build_model"]
