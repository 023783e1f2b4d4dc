"""`UlaCacheConnector`: the scheduler -> worker channel of `--kv-backend ulacache`.

A vLLM KV connector (the mechanism vLLM's HiSparse uses). Each step the scheduler's KV cache
manager hands it the step's payload (`LineManager.take_step`: the DSA line's freed logical
blocks, the arena's step plan), which reaches every worker before the forward pass
(`has_sync_kv_loads`); nothing moves per layer or when a request finishes. The worker side
holds the product line's `LineWorker`, built from the layout the KV cache config carries, and
calls its hooks at vLLM's points: `before_step` in `handle_preemptions` (before vLLM commits
the step's block tables), `begin_step` in `start_load_kv`, lost blocks in
`get_block_ids_with_load_errors`, counters as connector stats. It loads nothing from
outside: every request's KV is computed locally.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from .config import settings_from_additional_config
from .line import LineWorker, layout_of
from .lines import recorded_line
from .metrics import UlaPromMetrics, UlaStats
from .ranks import tp_rank

logger = init_logger("vllm.ulacache.connector")
CONNECTOR_NAME = "UlaCacheConnector"
MODULE_PATH = "ulacache_vllm.engine.connector"


@dataclass
class UlaConnectorMetadata(KVConnectorMetadata):
    step: Any = None  # the line's payload for this step (`LineManager.take_step`)


class UlaCacheConnector(KVConnectorBase_V1, SupportsHMA):
    # Nothing moves per layer or per finished request: the attention layers skip vLLM's
    # per-layer connector hooks (`patches/kv_layer_hooks`), the scheduler its per-request
    # finish hook (`scheduler._UlaSchedulerMixin._connector_finished`).
    NO_LAYER_HOOKS = True

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = settings_from_additional_config(vllm_config.additional_config)
        self.worker: LineWorker = LineWorker()  # the line's, once the KV caches are registered
        self._rank = 0

    # ---------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> UlaConnectorMetadata:
        # The step's payload must reach the worker before this step's forward.
        scheduler_output.has_sync_kv_loads = True
        return UlaConnectorMetadata(step=self._kv_cache_manager.take_step())

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_block_frees(self) -> bool:
        return self._kv_cache_manager.has_withheld_bytes()

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping (an empty step) until the worker has seen the frees.
        return self._kv_cache_manager.has_pending_frees()

    # ------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict) -> None:
        layout = layout_of(self._kv_cache_config)
        self._rank = tp_rank()
        self.worker = layout.build_worker(self._vllm_config, self._settings, kv_caches)
        logger.info("ulacache worker ready: %s",
                    layout.summary(self._vllm_config.model_config.max_model_len))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # The first thing vLLM's execute_model does, before it commits the block tables.
        self.worker.before_step(kv_connector_metadata.step)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UlaConnectorMetadata)
        self.worker.begin_step(meta.step, forward_context)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Blocks whose KV a failed copy lost this step. vLLM unions them over the workers and,
        # under its default kv_load_failure_policy "fail", the scheduler ends the requests
        # holding them with an error (`LineManager.lost_block_owners`); an exception here
        # would end the engine core.
        return self.worker.take_lost()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_kv_connector_stats(self):
        return self.worker.stats(self._rank)

    # -------------------------------------------------------------------- stats
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return UlaStats(data=dict(data)) if data is not None else UlaStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        # The series of the engine's line (`Line.metrics`).
        return UlaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                              recorded_line(vllm_config).metrics)


def ula_connector():
    """This process's `UlaCacheConnector` (vLLM's KV transfer group), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn if isinstance(conn, UlaCacheConnector) else None
