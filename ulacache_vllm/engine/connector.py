"""`UlaCacheConnector`: the scheduler -> worker channel of `--kv-backend ulacache`.

A vLLM KV connector (the mechanism vLLM's HiSparse uses) carrying, each step, the logical blocks
the scheduler freed since the last step; the worker side owns the `UlaWorkerStore` (pools and
mapping tables), applies those frees and advances the LRU round before the forward pass
(`has_sync_kv_loads`), and reports counters back as connector stats. For hybrid models it
carries the arena's step plan instead, which the worker's `ArenaWorker` applies in
`handle_preemptions` (before vLLM commits the step's block tables). It loads nothing from
outside: every request's KV is computed locally.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.logger import init_logger

from .config import settings_from_additional_config, trace_file_for
from .metrics import UlaPromMetrics, UlaStats, per_rank_gauges

logger = init_logger("vllm.ulacache.connector")
CONNECTOR_NAME = "UlaCacheConnector"
STATS_EVERY = 32
MODULE_PATH = "ulacache_vllm.engine.connector"


@dataclass
class UlaConnectorMetadata(KVConnectorMetadata):
    freed_blocks: list[int] = field(default_factory=list)
    arena: Any = None  # hybrid models: the step's ArenaStepPlan


class UlaCacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = settings_from_additional_config(vllm_config.additional_config)
        self.store = None
        self.arena = None  # hybrid models: the worker's ArenaWorker
        self._arena_reported: dict = {}

    # ---------------------------------------------------------------- scheduler
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> UlaConnectorMetadata:
        # Frees and the round advance must reach the worker before this step's forward.
        scheduler_output.has_sync_kv_loads = True
        mgr = self._kv_cache_manager
        if mgr is not None and hasattr(mgr, "take_step_plan"):  # the arena
            return UlaConnectorMetadata(arena=mgr.take_step_plan())
        freed = mgr.take_freed_blocks() if mgr is not None else []
        return UlaConnectorMetadata(freed_blocks=freed)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def has_pending_block_frees(self) -> bool:
        # Arena bytes withheld by the ledger come back when a step in flight completes:
        # the scheduler waits for them instead of preempting.
        mgr = self._kv_cache_manager
        return mgr is not None and hasattr(mgr, "has_withheld_bytes") and mgr.has_withheld_bytes()

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping (an empty step) until the worker has released them.
        mgr = self._kv_cache_manager
        return mgr is not None and mgr.has_pending_frees()

    # ------------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict) -> None:
        from .dsa.store import UlaWorkerStore

        arena = getattr(self._kv_cache_config, "ulacache_arena", None)
        if arena is not None:
            from .arena.worker import ArenaWorker
            from .faults import MoveFaults

            self.arena = ArenaWorker(arena, kv_caches, MoveFaults.from_env())
            self._rank = _tp_rank()
            logger.info("ulacache worker arena ready: %s", arena.summary())
            return
        layout = getattr(self._kv_cache_config, "ulacache_layout", None)
        if layout is None:
            raise RuntimeError("ulacache: the KV cache config carries no ulacache layout")
        ctx = self._vllm_config.compilation_config.static_forward_context
        device = next(iter(kv_caches.values())).device
        trace_file = None
        if self._settings.trace_path and _first_worker_of_engine():
            pc = self._vllm_config.parallel_config
            trace_file = trace_file_for(self._settings.trace_path, pc.data_parallel_rank,
                                        pc.data_parallel_size)
        exchange = None
        if layout.shards > 1:
            from vllm.distributed import parallel_state as ps

            from .dsa.tp_shard import TokenShard, TPExchange

            tp = ps.get_tp_group()
            if tp.world_size != layout.shards:
                raise RuntimeError(f"ulacache: TP group of {tp.world_size} ranks, layout for "
                                   f"{layout.shards}")
            # Small payloads over vLLM's CPU shared-memory communicator when it is up, the rest
            # over the TP group's gloo process group (a CUDA build would use device_group).
            dm = getattr(getattr(tp, "device_communicator", None), "dist_module", None)
            fast = None
            if dm is not None and type(dm).__name__ == "_CPUSHMDistributed":
                def fast(out, t, dm=dm):
                    dm.all_gather_into_tensor(out, t)
            exchange = TPExchange(TokenShard(tp.rank_in_group, tp.world_size), tp.cpu_group,
                                  lockstep_check=self._settings.tp_lockstep_check,
                                  fast_gather=fast)
            logger.info("ulacache TP shard mode: rank %d of %d, shared-memory gathers: %s",
                        tp.rank_in_group, tp.world_size, fast is not None)
        self.store = UlaWorkerStore(layout, self._settings, ctx, device, trace_file, exchange)
        # vLLM adds up the connector stats of all of an engine's workers: every rank reports
        # its own pools and counters (shards: different rows; replicas: every rank's copy and
        # moves are real memory and work), and the pool gauges are summed per rank.
        self._rank = _tp_rank()
        logger.info("ulacache worker store ready: %s", layout.summary(
            self._vllm_config.model_config.max_model_len))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        # The first thing vLLM's execute_model does: the arena's copies, v2g updates and
        # zeroing land before this step's block tables are committed and its forward runs.
        plan = getattr(kv_connector_metadata, "arena", None)
        if self.arena is not None and plan is not None:
            self.arena.apply(plan)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if self.store is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, UlaConnectorMetadata)
        # The pre-forward half of the worker contract: frees, settle, round, this step's
        # write slots (read from the forward context vLLM set up for this step).
        slot_mappings = getattr(forward_context, "slot_mapping", None)
        self.store.begin_step(meta.freed_blocks,
                              slot_mappings if isinstance(slot_mappings, dict) else None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Logical blocks whose rows a failed tier copy lost this step (`UlaWorkerStore._apply`).
        # vLLM unions them over the workers and, under its default kv_load_failure_policy
        # "fail", ends the requests holding them with an error (the client gets one) and
        # drops their tokens of this step; an exception here would end the engine core.
        # The arena reports lost pages' vids (unique across its kinds: the scheduler maps
        # them to requests itself, see `scheduler._UlaSchedulerMixin`).
        if self.arena is not None:
            return self.arena.take_lost()
        if self.store is None:
            return set()
        return self.store.take_lost_blocks()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_kv_connector_stats(self):
        # vLLM ships connector stats through the scheduler to the stat loggers every step it
        # gets them; that costs ~1-2 ms per step on a small CPU model, so report when pages
        # moved or pools changed, and otherwise every STATS_EVERY steps (counters accumulate).
        if self.arena is not None:
            return self._arena_stats()
        if self.store is None or not self.store.stats_due(STATS_EVERY):
            return None
        c = self.store.take_counters()
        data = {k: getattr(c, k) for k in c.__dataclass_fields__}
        data.update(per_rank_gauges(self.store.usage(), self._rank))
        return UlaStats(data=data)

    def _arena_stats(self):
        """The arena's counters as increments since the last report, its gauges as they are;
        sent when they changed."""
        from .metrics import ARENA_COUNTERS, arena_gauges

        # The scheduler's counters (in the plan's stats) and this worker's failed copies.
        s = {**self.arena.stats, "failed_copies": self.arena.counters["failed_copy_steps"]}
        if len(s) == 1:
            return None
        keys = ARENA_COUNTERS + ("failed_copies",)
        data = {}
        for k in keys:
            d = s.get(k, 0) - self._arena_reported.get(k, 0)
            if d:
                data[k] = d
        gauges = arena_gauges(s)
        if not data and gauges == self._arena_reported.get("gauges"):
            return None
        self._arena_reported = {**{k: s.get(k, 0) for k in keys}, "gauges": gauges}
        data.update(per_rank_gauges(gauges, self._rank))
        return UlaStats(data=data)

    # -------------------------------------------------------------------- stats
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return UlaStats(data=dict(data)) if data is not None else UlaStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return UlaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tp_rank() -> int:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tp_group().rank_in_group
    except AssertionError:  # groups not initialised (single-process tests)
        return 0


def _first_worker_of_engine() -> bool:
    """TP / PP rank 0: the one worker of an engine that writes the trace (the others would
    record the same rounds into the same file)."""
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tp_group().rank_in_group == 0 and ps.get_pp_group().rank_in_group == 0
    except AssertionError:  # groups not initialised (single-process tests)
        return True
