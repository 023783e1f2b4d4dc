"""The one protocol between the shared glue (connector, scheduler, worker extension, metrics,
patches) and a product line (today the logical address space for DSA models, the arena for
hybrid models and DeepSeek-V4's line over the arena's parts, each a package of `engine/`).

A line is a `Line` object, one per product package (`engine/<line>/line.py`): what it serves,
what it refuses, the engine arguments and configuration it sets, its sizing into a layout, its
metrics, whether it runs on CUDA, and the vLLM-side support its models need on the CPU build
whatever the KV backend. `engine.lines` holds the list of lines and the one function that
chooses a line from the model config, once, in the front end; the choice is recorded in
`additional_config` and read back from there by the glue and the patches, which never name a
line. From the engine core's sizing on, the line also travels as its layout: the
`UlaKVCacheConfig` vLLM hands to the scheduler and every worker holds the layout, which names
its scheduler-side manager and builds its worker-side half. The glue calls the hooks below
and nothing else; every hook has a default, so a line overrides only what it does (the pattern
of SGLang's allocator base: no feature branch at the caller).

Per step, in order: the scheduler's manager hands the step's payload to the connector
(`take_step`: freed blocks, or the arena's step plan); the worker applies it before vLLM
commits block tables (`before_step`), commits block tables (`commit_block_table`), runs the
pre-forward half of its contract (`begin_step`); after the step, lost blocks go back
(`take_lost`) and the scheduler closes the step (`step_processed`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from vllm.v1.kv_cache_interface import KVCacheConfig

from .config import EXPERIMENTAL_CUDA_ENV, KVBackendError, UlaSettings, experimental_cuda_enabled



class LineLayout:
    """What the engine core's sizing decided for one line (a dataclass per line)."""

    def manager_cls(self) -> type:
        """The scheduler's KV cache manager class (a `KVCacheManager` + `LineManager`)."""
        raise NotImplementedError

    def build_worker(self, vllm_config: Any, settings: Any, kv_caches: dict) -> "LineWorker":
        """The worker-side half, built when the connector receives the KV caches."""
        raise NotImplementedError

    def summary(self, max_model_len: int) -> str:
        """The startup line: what the KV budget holds (logged by the engine core's sizing and
        again when a worker is ready)."""
        return f"ulacache {type(self).__name__}"


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

    def lost_block_owners(self, block_ids: set[int], holders: list,
                          vllm_default: Callable[[], set[str]]) -> set[str]:
        """Ids of the requests to end for blocks a failed copy lost, among ``holders`` (every
        request holding blocks: running ones, and waiting ones vLLM lets keep theirs, such as
        streaming sessions between inputs); vLLM's own mapping by default (one KV cache group:
        running requests and remote loads only)."""
        return vllm_default()

    def step_processed(self, payload: Any) -> None:
        """The scheduler processed the output of the step that carried ``payload``."""
        return None

    def prefill_checkpoint_stop(self, request: Any) -> int:
        """A token position where a prefill chunk of ``request`` must also end, besides
        vLLM's own stops (GDN/mamba "align" mode checkpoints a state only where a chunk
        ends), or 0."""
        return 0

    def prefill_split_block(self) -> int:
        """A block (tokens) coarser than the engine's at which vLLM's GDN/mamba "align"
        split runs instead, so prefill chunks and state checkpoints end where they would at
        that block; 0: the engine's own block."""
        return 0


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

    def translate_ids(self, block_ids: list[int]) -> list[int]:
        """The ids under which vLLM's own per-block copies (the "align" mode's recurrent-state
        copies, `patches/mamba_align_translate`) find ``block_ids``' KV: the ids themselves
        unless the line moves pages under stable ids."""
        return block_ids


@dataclass(frozen=True)
class LineMetrics:
    """A line's Prometheus series (`vllm:ulacache_<name>`, counters with `_total`): name ->
    help text. Counters travel as increments, gauges per rank (`metrics.per_rank_gauges`)."""

    counters: dict[str, str] = field(default_factory=dict)
    gauges: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CpuSparseAttention:
    """What a line brings so that its models' index-based sparse attention runs on vLLM's CPU
    build, under any `--kv-backend` (stock vLLM's CPU build has no sparse backend):
    installed by `patches/cpu_sparse_attention`, which hands every other model to vLLM."""

    backend_path: str  # the attention backend of the sparse layers (registered as CUSTOM)
    indexer_backend: type  # the backend of the indexer's key cache
    indexer_forward: Callable  # `SparseAttnIndexer.forward_cpu` for the line's indexers
    quant_fp8: Callable  # `per_token_group_quant_fp8` where vLLM's Triton one cannot run


class Line:
    """A product line of `--kv-backend ulacache`: everything the glue needs from it. One
    instance per line, in its package (`engine/<name>/line.py`), listed in `engine.lines`.
    Every hook has a default; a line overrides what it does."""

    name: str = ""  # recorded in additional_config (`engine.lines.LINE_KEY`)
    # What it serves, for the refusal of a model no line serves ("... serves <this>").
    serves_text: str = ""
    metrics: LineMetrics = LineMetrics()
    # Runs on a non-CPU platform behind the experimental opt-in (`EXPERIMENTAL_CUDA_ENV`);
    # otherwise refused there with `cuda_refusal`.
    runs_on_cuda: bool = False
    # vLLM's CPU platform pads hybrid models' attention blocks to the recurrent-state page
    # (`patches/hybrid_block_size`); a line that stores each kind at its own size skips it.
    aligns_hybrid_block_size: bool = True

    def __repr__(self) -> str:
        return f"<ulacache line {self.name!r}>"

    # ------------------------------------------------------------- model choice
    def serves(self, hf_config: Any) -> bool:
        """Whether this line serves the model (`engine.lines.choose_line` asks each line)."""
        return False

    def refusal(self, hf_config: Any) -> str | None:
        """The message for a model this line recognises but refuses (asked before `serves`
        of any line), or None."""
        return None

    # ------------------------------------------------------------ configuration
    def prepare_engine_args(self, engine_args: Any) -> None:
        """Front end, before vLLM builds its configuration from ``engine_args``."""
        return None

    def prepare(self, vllm_config: Any, settings: UlaSettings) -> None:
        """Front end, after the configuration is built: refusals naming the fix, and what the
        line sets in it."""
        return None

    @property
    def cuda_refusal(self) -> str:
        return (f"--kv-backend ulacache runs {self.serves_text} on vLLM's CPU build only. "
                f"Use --kv-backend vllm on this machine.")

    def check_platform(self, vllm_config: Any) -> None:
        """Front end: refuses a non-CPU platform unless the line runs on CUDA and the
        experimental opt-in is set; then checks the configuration (`check_cuda_config`)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return
        if not (self.runs_on_cuda and experimental_cuda_enabled()):
            raise KVBackendError(self.cuda_refusal)
        self.check_cuda_config(vllm_config)

    def check_cuda_config(self, vllm_config: Any) -> None:
        """What the line's CUDA glue does not cover, refused with the fix."""
        return None

    # ------------------------------------------------------------------ sizing
    def get_kv_cache_configs(self, orig: Callable, vllm_config: Any, kv_cache_specs: list[dict],
                             available_memory: list[int],
                             settings: UlaSettings) -> list[UlaKVCacheConfig]:
        """The engine core's KV cache configs (`patches/kv_cache_sizing`; ``orig`` is vLLM's
        own sizing), each carrying the line's layout."""
        raise NotImplementedError

    # ------------------------------------------------------ vLLM-side support
    def cpu_sparse_attention(self) -> CpuSparseAttention | None:
        """The CPU sparse-attention support the line's models need (any KV backend)."""
        return None

    def cuda_attention_backend(self) -> str | None:
        """The attention backend of the sparse layers of a ulacache engine on CUDA (the
        experimental glue), or None for vLLM's choice."""
        return None

    def translate_slot_mappings(self, by_layer: dict, register: bool) -> dict:
        """CUDA (experimental glue): the per-layer slot mappings vLLM built, as the line's
        active worker wants them (``register=False``: graph capture's dummy batches)."""
        return by_layer
