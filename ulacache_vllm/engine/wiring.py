"""Turns `kv_backend=ulacache` into vLLM configuration: connector, scheduler class, checks."""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from .config import KVBackendError, UlaSettings

logger = init_logger("vllm.ulacache")

SYNC_SCHEDULER = "ulacache_vllm.engine.scheduler.UlaScheduler"
ASYNC_SCHEDULER = "ulacache_vllm.engine.scheduler.UlaAsyncScheduler"
WORKER_EXTENSION = "ulacache_vllm.engine.worker_ext.UlaWorkerExtension"
LRU_CHOICES = ("pblru", "exact_ts", "exact_list")


def prepare_engine_args(engine_args: Any, settings: UlaSettings) -> None:
    """Runs before VllmConfig is built: set the fields vLLM reads while building it."""
    from vllm.config.kv_transfer import KVTransferConfig

    from .connector import CONNECTOR_NAME, MODULE_PATH

    if settings.lru not in LRU_CHOICES:
        raise KVBackendError(f"--ula-lru {settings.lru!r} is not one of {', '.join(LRU_CHOICES)}")
    if settings.host_pool_gib < 0:
        raise KVBackendError("--ula-host-pool-gib must be >= 0")
    ktc = engine_args.kv_transfer_config
    if ktc is not None and getattr(ktc, "kv_connector", None) not in (None, CONNECTOR_NAME):
        raise KVBackendError(
            f"--kv-backend ulacache brings its own KV connector and cannot be combined with "
            f"--kv-transfer-config {ktc.kv_connector!r} yet; drop one of them."
        )
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_module_path=MODULE_PATH)
    if engine_args.enable_prefix_caching:
        logger.warning("ulacache: prefix caching is not supported yet; disabling it")
    # Logical blocks are released to the worker when freed; cached-but-free blocks would keep
    # slots the scheduler already counts as free.
    engine_args.enable_prefix_caching = False
    if not engine_args.worker_extension_cls:
        engine_args.worker_extension_cls = WORKER_EXTENSION


def finalize_vllm_config(vllm_config: Any, settings: UlaSettings) -> None:
    """Runs after VllmConfig is built and the model is known to be supported."""
    sc = vllm_config.scheduler_config
    sc.scheduler_cls = ASYNC_SCHEDULER if sc.async_scheduling else SYNC_SCHEDULER
