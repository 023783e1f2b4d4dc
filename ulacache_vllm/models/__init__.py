"""Tiny-model factory: deterministic random-weight HF checkpoints for tests and the default.

``build_model(name, outdir, overrides=None, seed=0, weights_from=None)``; ``MODEL_NAMES``
lists the transformers-built families, ``ALL_MODEL_NAMES`` adds the directly written
ones (``deepseek_v4``); CLI: ``python -m ulacache_vllm.models {list,build NAME OUTDIR}``.
"""

from .configs import FAMILIES, MODEL_NAMES
from .factory import ALL_MODEL_NAMES, build_dense_twin, build_model

__all__ = ["ALL_MODEL_NAMES", "FAMILIES", "MODEL_NAMES", "build_dense_twin", "build_model"]
