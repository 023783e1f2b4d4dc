"""Hooks of the EXPERIMENTAL CUDA glue of the lines that run on CUDA (`Line.runs_on_cuda`: the
DSA line's `engine/dsa/cuda`), installed only on a CUDA platform with
``ULACACHE_EXPERIMENTAL_CUDA=1``; a no-op everywhere else.

- `CudaPlatform.get_attn_backend_cls` (platforms/cuda.py): a sparse-MLA layer of an engine
  running ``--kv-backend ulacache`` gets its line's backend (`Line.cuda_attention_backend`,
  the DSA line's `UlaFlashMLASparseBackend`); stock engines (and non-sparse layers) keep
  vLLM's choice.
- `build_slot_mappings_by_layer` (v1/worker/gpu/attn_utils.py, and the names the V2 model
  runner and its CUDA-graph manager imported from it): each line rewrites the mappings its
  active worker owns (`Line.translate_slot_mappings`: the DSA line's MLA layers get views of
  its static slot-mapping buffer, same address at capture and replay, filled with translated
  rows in the pre-forward step; indexer layers keep the logical slots).
Checked against vLLM 0.32.0; fails loudly (VllmHookError) if a hook point moved.
"""
from __future__ import annotations

from ._hook import replace

HOOK = "cuda_sparse_backend"
SLOT_MAPPING_MODULES = ("vllm.v1.worker.gpu.attn_utils", "vllm.v1.worker.gpu.model_runner",
                        "vllm.v1.worker.gpu.cudagraph_utils")


def _line_backend() -> str | None:
    """The CUDA sparse-MLA backend of the line recorded for the current engine, or None (a
    stock engine, or no config in scope)."""
    from vllm.config import get_current_vllm_config_or_none

    from ulacache_vllm.engine.lines import recorded_line

    cfg = get_current_vllm_config_or_none()
    line = recorded_line(cfg) if cfg is not None else None
    return line.cuda_attention_backend() if line is not None else None


def select_backend(orig, cls, selected_backend, attn_selector_config, num_heads=None):
    if attn_selector_config.use_sparse:
        path = _line_backend()
        if path is not None:
            return path
    return orig(cls, selected_backend, attn_selector_config, num_heads)


def translate_slot_mappings(by_layer: dict, register: bool = True) -> dict:
    """``by_layer`` as the lines' active workers want it (module doc); ``register=False``
    (graph capture's dummy batches): static buffers without their slots."""
    from ulacache_vllm.engine.lines import LINES

    for line in LINES:
        by_layer = line.translate_slot_mappings(by_layer, register)
    return by_layer


def install(force: bool = False) -> bool:
    """Installs the hooks (``force``: whatever the platform and environment). Returns whether
    they were installed."""
    from vllm.platforms import current_platform

    from ulacache_vllm.engine.config import experimental_cuda_enabled

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
