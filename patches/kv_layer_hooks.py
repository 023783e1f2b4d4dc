"""Hook: `has_kv_transfer_group` as the attention layers read it
(`model_executor/layers/attention/kv_transfer_utils.py`, `maybe_transfer_kv_layer`).

With any KV connector vLLM runs, per attention layer and step, a forward-context lookup and
the connector's `wait_for_layer_load` and `save_kv_layer`. ulacache's connector moves
nothing per layer (its step plan is applied before the forward), so where it is the
connector the layers see no transfer group and run as stock's do. Any other connector
(one wrapping ulacache's included) keeps its per-layer hooks.
"""
from __future__ import annotations

from ._hook import VllmHookError, replace, resolve

HOOK = "kv_layer_hooks"
MODULE = "vllm.model_executor.layers.attention.kv_transfer_utils"


def _reads_per_call(decorator, name: str) -> bool:
    """Whether the wrapper ``decorator`` builds looks ``name`` up in its module per call."""
    return any(getattr(c, "co_name", None) == "wrapper" and name in c.co_names
               for c in decorator.__code__.co_consts)


def apply() -> None:
    _, orig = resolve(MODULE, "has_kv_transfer_group", HOOK)
    _, deco = resolve(MODULE, "maybe_transfer_kv_layer", HOOK)
    if not _reads_per_call(deco, "has_kv_transfer_group"):
        raise VllmHookError(f"ulacache patch '{HOOK}': maybe_transfer_kv_layer's wrapper no "
                            "longer reads has_kv_transfer_group per call")
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    def has_kv_transfer_group() -> bool:
        return orig() and not getattr(get_kv_transfer_group(), "NO_LAYER_HOOKS", False)

    replace(MODULE, "has_kv_transfer_group", has_kv_transfer_group, HOOK)
