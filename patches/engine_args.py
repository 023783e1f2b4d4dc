"""Hook: `EngineArgs.__init__` and `AsyncEngineArgs.__init__` (engine/arg_utils.py), plus
read-only `kv_backend` / `ula_*` attributes on both.

vLLM's convention is that every engine setting is an `EngineArgs` field, so `kv_backend` and
the `ula_*` settings (`engine.config.UlaSettings`) are accepted as keywords by both classes:
`AsyncLLM.from_engine_args(AsyncEngineArgs(model, kv_backend="ulacache",
ula_host_pool_gib=8))`. They are folded into `additional_config` (which travels to every vLLM
process) and validated exactly as `LLM(...)` does (`llm_kwargs.py` shares `split_kwargs`): an
unknown backend, an unknown `ula_*` name or a bad value raises `KVBackendError` naming it.

vLLM loads its general plugins inside `EngineArgs.__post_init__`, i.e. after `__init__` has
already refused unknown keywords, so this patch must be in place before the first
construction: the post-import hook (`import_hook.py`, installed as a `.pth` file) applies it
the moment `vllm.engine.arg_utils` is first imported; the plugin applies it again (a no-op).
"""
from __future__ import annotations

from ulacache_vllm.engine import config as ula_config

from ._hook import replace

HOOK = "engine_args"
MODULE = "vllm.engine.arg_utils"


def split_kwargs(kwargs: dict) -> tuple[str | None, dict]:
    """Pops `kv_backend` and every `ula_*` keyword out of `kwargs`; returns (backend or None,
    {setting name without the prefix: value}). Unknown `ula_*` names are kept for the
    validation in `merge_into_additional_config`, which rejects them by name."""
    backend = kwargs.pop("kv_backend", None)
    settings = {k[len("ula_"):]: kwargs.pop(k) for k in list(kwargs) if k.startswith("ula_")}
    return backend, settings


def _with_settings(orig_init):
    def __init__(self, *args, **kwargs):
        backend, settings = split_kwargs(kwargs)
        if backend is not None or settings:
            # As `LLM(...)` does: validated and folded in before vLLM's own __init__ runs.
            kwargs["additional_config"] = ula_config.merge_into_additional_config(
                kwargs.get("additional_config"), backend, settings)
        orig_init(self, *args, **kwargs)

    return __init__


def _kv_backend(self) -> str:
    return ula_config.backend_from_additional_config(self.additional_config)


def _setting_property(name: str) -> property:
    return property(
        lambda self: getattr(ula_config.settings_from_additional_config(self.additional_config),
                             name),
        doc=f"ulacache setting {name} (read from additional_config)")


def apply() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    for cls in (EngineArgs, AsyncEngineArgs):
        # `replace` checks the vLLM version first, then leaves an already patched __init__ as
        # it is (a second apply, from the plugin or `apply_all`, never wraps twice).
        replace(MODULE, f"{cls.__name__}.__init__", _with_settings(cls.__init__), HOOK)
    if not isinstance(EngineArgs.__dict__.get("kv_backend"), property):
        EngineArgs.kv_backend = property(_kv_backend, doc="the KV backend this engine uses")
    for name, *_ in ula_config.setting_fields():
        if not isinstance(EngineArgs.__dict__.get(f"ula_{name}"), property):
            setattr(EngineArgs, f"ula_{name}", _setting_property(name))
