"""The one protocol between the shared glue (connector, scheduler, worker extension, patches)
and a product line (`dsa`: the logical address space; `arena`: hybrid models).

The line is decided once, where the engine core sizes the KV cache (`patches/kv_cache_sizing`
calls the line's sizing), and carried explicitly from there: the `UlaKVCacheConfig` vLLM
hands to the scheduler and every worker holds the line's layout, the layout names its
scheduler-side manager and builds its worker-side half. The glue calls the hooks below and
nothing else; every hook has a default, so a line overrides only what it does (the pattern
of SGLang's allocator base: no feature branch at the caller).

Per step, in order: the scheduler's manager hands the step's payload to the connector
(`take_step`: freed blocks, or the arena's step plan); the worker applies it before vLLM
commits block tables (`before_step`), commits block tables (`commit_block_table`), runs the
pre-forward half of its contract (`begin_step`); after the step, lost blocks go back
(`take_lost`) and the scheduler closes the step (`step_processed`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from vllm.v1.kv_cache_interface import KVCacheConfig


class LineLayout:
    """What the engine core's sizing decided for one line (a dataclass per line)."""

    def manager_cls(self) -> type:
        """The scheduler's KV cache manager class (a `KVCacheManager` + `LineManager`)."""
        raise NotImplementedError

    def build_worker(self, vllm_config: Any, settings: Any, kv_caches: dict) -> "LineWorker":
        """The worker-side half, built when the connector receives the KV caches."""
        raise NotImplementedError


@dataclass
class UlaKVCacheConfig(KVCacheConfig):
    """vLLM's KV cache config with the line's layout (copied and pickled with it to the
    scheduler and every worker)."""

    layout: LineLayout | None = None

    @classmethod
    def of(cls, cfg: KVCacheConfig, layout: LineLayout) -> "UlaKVCacheConfig":
        from dataclasses import fields

        return cls(**{f.name: getattr(cfg, f.name) for f in fields(KVCacheConfig)},
                   layout=layout)


def layout_of(kv_cache_config: Any) -> LineLayout:
    if not isinstance(kv_cache_config, UlaKVCacheConfig) or kv_cache_config.layout is None:
        raise RuntimeError("ulacache: the KV cache config carries no ulacache layout (the "
                           "engine core's sizing hook did not run)")
    return kv_cache_config.layout


class LineManager:
    """Scheduler-side hooks, mixed into a line's `KVCacheManager` subclass."""

    def take_step(self) -> Any:
        """The step's payload for the worker (travels in the connector metadata)."""
        return None

    def has_pending_frees(self) -> bool:
        """Work the worker must still see: keeps the engine stepping while idle."""
        return False

    def has_withheld_bytes(self) -> bool:
        """Memory that returns when a step in flight completes: the scheduler waits for it
        instead of preempting."""
        return False

    def lost_block_owners(self, block_ids: set[int], running: list,
                          vllm_default: Callable[[], set[str]]) -> set[str]:
        """Ids of the requests to end for blocks a failed copy lost (vLLM's own mapping by
        default: one KV cache group)."""
        return vllm_default()

    def step_processed(self, payload: Any) -> None:
        """The scheduler processed the output of the step that carried ``payload``."""
        return None


class LineWorker:
    """Worker-side hooks of a line (one per worker process)."""

    def before_step(self, payload: Any) -> None:
        """First thing of a step, before vLLM commits its block tables."""
        return None

    def commit_block_table(self, block_table: Any, num_reqs: int) -> bool:
        """Commit vLLM's ``BlockTable`` itself; False: vLLM's own copy runs."""
        return False

    def begin_step(self, payload: Any, forward_context: Any) -> None:
        """The pre-forward half of the worker contract (after block tables are committed)."""
        return None

    def take_lost(self) -> set[int]:
        """Block ids whose KV a failed copy lost since the last call."""
        return set()

    def stats(self, rank: int):
        """Connector stats for this step (a `metrics.UlaStats`), or None when nothing is due."""
        return None

    def usage(self) -> dict:
        """The `ulacache_usage` RPC's answer: pools, counters, settings in effect."""
        return {}
