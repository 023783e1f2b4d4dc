"""Turns `kv_backend=ulacache` into vLLM configuration (scheduler class, connector, checks)."""
from __future__ import annotations

from typing import Any

from .config import KVBackendError, UlaSettings


def prepare_engine_args(engine_args: Any, settings: UlaSettings) -> None:
    """Runs before VllmConfig is built: set the fields vLLM reads while building it."""


def finalize_vllm_config(vllm_config: Any, settings: UlaSettings) -> None:
    """Runs after VllmConfig is built and the model is known to be supported."""
    raise KVBackendError(
        "--kv-backend ulacache is not available yet in this build: its KV cache manager "
        "has not landed. Use --kv-backend vllm (the default) for now."
    )
