"""Hooks of the EXPERIMENTAL CUDA glue (ulacache_vllm/engine/dsa/cuda), installed only on a CUDA
platform with ``ULACACHE_EXPERIMENTAL_CUDA=1``; a no-op everywhere else.

- `CudaPlatform.get_attn_backend_cls` (platforms/cuda.py): a sparse-MLA layer of an engine
  running ``--kv-backend ulacache`` gets `UlaFlashMLASparseBackend`; stock engines (and
  non-sparse layers) keep vLLM's choice.
- `build_slot_mappings_by_layer` (v1/worker/gpu/attn_utils.py, and the names the V2 model
  runner and its CUDA-graph manager imported from it): the MLA layers registered with the
  active `CudaRows` get a view of its static slot-mapping buffer (same address at capture and
  replay), filled with translated rows in the pre-forward step; indexer layers keep the
  logical slots (indexer keys stay at their logical rows, as on the CPU build).
Checked against vLLM 0.32.0; fails loudly (VllmHookError) if a hook point moved.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "cuda_sparse_backend"
SLOT_MAPPING_MODULES = ("vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.gpu.model_runner",
                        "vllm.v1.worker.gpu.cudagraph_utils")

from ulacache_vllm.engine.dsa.cuda.runtime import ACTIVE  # the worker's CudaRows, or None


def _ulacache_engine() -> bool:
    from vllm.config import get_current_vllm_config

    from ulacache_vllm.engine.config import kv_backend_of

    try:
        return kv_backend_of(get_current_vllm_config()) == "ulacache"
    except Exception:  # noqa: BLE001  (no config in scope)
        return False


def select_backend(orig, cls, selected_backend, attn_selector_config, num_heads=None):
    if getattr(attn_selector_config, "use_sparse", False) and _ulacache_engine():
        from ulacache_vllm.engine.dsa.cuda.backend import BACKEND_PATH

        return BACKEND_PATH
    return orig(cls, selected_backend, attn_selector_config, num_heads)


def translate_slot_mappings(by_layer: dict, register: bool = True) -> dict:
    """``by_layer`` with the active rows' MLA layers on their static buffers (module doc);
    ``register=False`` (graph capture's dummy batches): the buffers without their slots."""
    rows = ACTIVE["rows"]
    if rows is None:
        return by_layer
    out = dict(by_layer)
    for name in rows.layers:
        if name in out:
            out[name] = (rows.register_writes(name, out[name]) if register
                         else rows.static_view(name, out[name]))
    return out


def install(force: bool = False) -> bool:
    """Installs the hooks (``force``: whatever the platform and environment). Returns whether
    they were installed."""
    from vllm.platforms import current_platform

    from ulacache_vllm.engine.dsa.cuda import experimental_cuda_enabled

    if not force and not (current_platform.is_cuda() and experimental_cuda_enabled()):
        return False
    install_backend_choice()
    install_slot_mappings()
    return True


def install_backend_choice() -> None:
    """`CudaPlatform.get_attn_backend_cls` (vllm.platforms.cuda imports only on a CUDA build)."""
    from ._hook import resolve

    _, cur = resolve("vllm.platforms.cuda", "CudaPlatform.get_attn_backend_cls", HOOK)
    orig_select = getattr(cur, "__ulacache_original__", cur).__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        return select_backend(orig_select, cls, selected_backend, attn_selector_config,
                              num_heads)

    replace("vllm.platforms.cuda", "CudaPlatform.get_attn_backend_cls",
            classmethod(get_attn_backend_cls), HOOK)


def install_slot_mappings() -> None:
    """`build_slot_mappings_by_layer` where it is defined and where the V2 runner imported it."""
    import importlib

    orig_build = importlib.import_module(SLOT_MAPPING_MODULES[0]).build_slot_mappings_by_layer
    orig_build = getattr(orig_build, "__ulacache_original__", orig_build)

    def build_slot_mappings_by_layer(slot_mappings, kv_cache_config):
        return translate_slot_mappings(orig_build(slot_mappings, kv_cache_config))

    def build_for_capture(slot_mappings, kv_cache_config):
        return translate_slot_mappings(orig_build(slot_mappings, kv_cache_config), False)

    for mod in SLOT_MAPPING_MODULES:
        fn = build_for_capture if mod.endswith("cudagraph_utils") else build_slot_mappings_by_layer
        replace(mod, "build_slot_mappings_by_layer", fn, HOOK)


def apply() -> None:
    install()
