"""Hook: `LLM.__init__` (entrypoints/llm.py).

vLLM's convention is that every `LLM` keyword is an `EngineArgs` field. `kv_backend` and the
`ula_*` settings (`engine.config.UlaSettings`) are accepted as `LLM` keywords
(`LLM(model, kv_backend="ulacache")`, lm-eval's `--model_args ...,kv_backend=ulacache`) and
validated the same way as by `EngineArgs` / `AsyncEngineArgs` (`engine_args.py`, which owns
`split_kwargs`): they are folded into `additional_config`, which travels to every vLLM process.
This hook also turns an engine core's refusal of the ulacache configuration back into the
`KVBackendError` it raised there.
"""
from __future__ import annotations

from ulacache_vllm.engine import config as ula_config

from . import engine_args
from ._hook import replace
from .engine_args import split_kwargs

__all__ = ["apply", "split_kwargs"]

HOOK = "llm_kwargs"
MODULE = "vllm.entrypoints.llm"


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
    engine_args.apply()  # LLM builds its EngineArgs from the same keywords (idempotent)
