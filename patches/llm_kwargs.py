"""Hook: `LLM.__init__` (entrypoints/llm.py).

`LLM(model, kv_backend="ulacache", ula_host_pool_gib=...)` (and so lm-eval's
`--model_args ...,kv_backend=ulacache`) would reach `EngineArgs(...)` as unknown keyword
arguments; they are folded into `additional_config` here instead.
"""
from __future__ import annotations

from ulacache_vllm.engine import config as ula_config

from ._hook import replace

HOOK = "llm_kwargs"
MODULE = "vllm.entrypoints.llm"


def split_kwargs(kwargs: dict) -> tuple[str | None, dict]:
    backend = kwargs.pop("kv_backend", None)
    settings = {k[len("ula_"):]: kwargs.pop(k) for k in list(kwargs) if k.startswith("ula_")}
    return backend, settings


def apply() -> None:
    import vllm.entrypoints.llm as llm_mod

    orig_init = llm_mod.LLM.__init__

    def __init__(self, *args, **kwargs):
        backend, settings = split_kwargs(kwargs)
        if backend is not None or settings:
            kwargs["additional_config"] = ula_config.merge_into_additional_config(
                kwargs.get("additional_config"), backend, settings
            )
        try:
            orig_init(self, *args, **kwargs)
        except Exception as e:
            # An engine core that refused the ulacache configuration left its message (the
            # sizes needed and the fix); vLLM itself only says "Engine core initialization
            # failed".
            msg = ula_config.take_engine_error() if not isinstance(e, ula_config.KVBackendError) else None
            if msg:
                raise ula_config.KVBackendError(msg) from e
            raise

    replace(MODULE, "LLM.__init__", __init__, HOOK)
