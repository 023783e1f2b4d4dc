"""Hooks: `LLM.__init__` (entrypoints/llm.py), `EngineArgs.__init__` and
`AsyncEngineArgs.__init__` (engine/arg_utils.py).

vLLM's convention is that every `LLM` keyword is an `EngineArgs` field. `kv_backend` and the
`ula_*` settings (`engine.config.UlaSettings`) are accepted as keywords by all three
(`LLM(model, kv_backend="ulacache")`, lm-eval's `--model_args ...,kv_backend=ulacache`,
`AsyncLLM.from_engine_args(AsyncEngineArgs(..., kv_backend="ulacache"))`) and validated the
same way: they are folded into `additional_config`, which travels to every vLLM process. An
engine args object reads them back as attributes (`engine_args.kv_backend`).
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
    apply_engine_args()


def _with_settings(orig_init):
    def __init__(self, *args, **kwargs):
        backend, settings = split_kwargs(kwargs)
        orig_init(self, *args, **kwargs)
        if backend is not None or settings:
            self.additional_config = ula_config.merge_into_additional_config(
                self.additional_config, backend, settings)

    return __init__


def _kv_backend(self) -> str:
    return ula_config.backend_from_additional_config(self.additional_config)


def apply_engine_args() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    for cls in (EngineArgs, AsyncEngineArgs):
        replace("vllm.engine.arg_utils", f"{cls.__name__}.__init__",
                _with_settings(cls.__init__), HOOK)
    if not isinstance(getattr(EngineArgs, "kv_backend", None), property):
        EngineArgs.kv_backend = property(_kv_backend, doc="the KV backend this engine uses")
        for name, *_ in ula_config.setting_fields():
            setattr(EngineArgs, f"ula_{name}", property(
                lambda self, n=name: getattr(
                    ula_config.settings_from_additional_config(self.additional_config), n)))
