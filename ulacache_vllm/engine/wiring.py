"""Turns `kv_backend=ulacache` into vLLM configuration: connector, scheduler class, checks."""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from ulacache_vllm.core.policies import POLICIES

from .config import KVBackendError, UlaSettings

logger = init_logger("vllm.ulacache")

SYNC_SCHEDULER = "ulacache_vllm.engine.scheduler.UlaScheduler"
ASYNC_SCHEDULER = "ulacache_vllm.engine.scheduler.UlaAsyncScheduler"
WORKER_EXTENSION = "ulacache_vllm.engine.worker_ext.UlaWorkerExtension"
LRU_CHOICES = tuple(POLICIES)


def prepare_engine_args(engine_args: Any, settings: UlaSettings) -> None:
    """Runs before VllmConfig is built: set the fields vLLM reads while building it."""
    from vllm.config.kv_transfer import KVTransferConfig

    from .connector import CONNECTOR_NAME, MODULE_PATH

    if settings.lru not in LRU_CHOICES:
        raise KVBackendError(f"--ula-lru {settings.lru!r} is not one of {', '.join(LRU_CHOICES)}")
    if settings.host_pool_gib < 0:
        raise KVBackendError("--ula-host-pool-gib must be >= 0")
    if settings.trace_path:
        check_trace_path(settings.trace_path)
    ktc = engine_args.kv_transfer_config
    if ktc is not None and getattr(ktc, "kv_connector", None) not in (None, CONNECTOR_NAME):
        raise KVBackendError(
            f"--kv-backend ulacache brings its own KV connector and cannot be combined with "
            f"--kv-transfer-config {ktc.kv_connector!r} yet; drop one of them."
        )
    # A row copy that fails in the worker's move path is reported as lost blocks; "fail" ends
    # the requests that own them with an error (never a silent recompute over lost rows).
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_module_path=MODULE_PATH,
        kv_load_failure_policy="fail")
    # Prefix caching stays off under ulacache: a cached block's rows may sit in the host tier,
    # and a hit must promote them before the prefill that reads them; that path (scheduler-side
    # hit + worker-side promotion of a cached prefix) is not built yet. vLLM's CPU build keeps
    # prefix caching on by default for MLA on AMX hosts, so say so whatever the source.
    if engine_args.enable_prefix_caching is not False:
        logger.info("ulacache: prefix caching is turned off (cached prefixes whose rows sit in "
                    "the host tier are not promoted on a hit yet)")
    engine_args.enable_prefix_caching = False
    if engine_args.max_num_batched_tokens is None:
        from .dsa.sizing import DEFAULTED_KEY

        # Left to vLLM's default: the engine core may lower it to what the device pool holds
        # (sizing.plan_layout) instead of refusing to start.
        engine_args.additional_config = {**(engine_args.additional_config or {}),
                                         DEFAULTED_KEY: ["max_num_batched_tokens"]}
    if not engine_args.worker_extension_cls:
        engine_args.worker_extension_cls = WORKER_EXTENSION


def check_trace_path(path: str) -> None:
    """Fail before any model loads when the trace file cannot be written (the worker opens it
    only after loading the weights, where an error surfaces as a generic engine failure)."""
    import os

    flag = "ula_trace_path (--ula-trace-path)"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise KVBackendError(f"{flag} {path!r} is a directory; give a file name in it")
    if not os.path.isdir(parent):
        raise KVBackendError(f"{flag}: directory {parent!r} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise KVBackendError(f"{flag}: {path!r} is not writable")


def finalize_vllm_config(vllm_config: Any, settings: UlaSettings) -> None:
    """Runs after VllmConfig is built and the model is known to be supported."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # The logical->physical translation is wired into the CPU sparse-MLA backend only;
        # vLLM's CUDA sparse backends would read the pools through their own block-table
        # conversion and return wrong rows, so refuse instead of serving corrupted output.
        raise KVBackendError(
            "--kv-backend ulacache currently runs on vLLM's CPU build only: its translation "
            "hook (SparseMLAIndexGroup.convert_logical_to_physical_topk) is not wired into the "
            "CUDA sparse-MLA backends yet. Use --kv-backend vllm on this machine."
        )
    from .config import is_arena_model

    if is_arena_model(vllm_config.model_config.hf_config):
        prepare_arena(vllm_config)
    else:
        check_tp_mode(vllm_config, settings)
        check_host_pool(vllm_config, settings)
    keep_cpu_core_reservation(vllm_config)
    set_error_file()
    sc = vllm_config.scheduler_config
    sc.scheduler_cls = ASYNC_SCHEDULER if sc.async_scheduling else SYNC_SCHEDULER


ARENA_BLOCK_SIZE = 32  # tokens per attention page (CPU_ATTN takes multiples of 32)


def prepare_arena(vllm_config: Any) -> None:
    """Hybrid models: what the arena does not support yet is refused here, naming the fix;
    the attention page defaults to 32 tokens instead of the CPU build's 128."""
    pc = vllm_config.parallel_config
    fix = " Use --kv-backend vllm for this setup."
    # Tensor parallelism: every rank holds its heads' share of every page, so one plan (the
    # same vids, granules and copies) serves every rank's buffer.
    if pc.pipeline_parallel_size > 1:
        raise KVBackendError(
            f"--kv-backend ulacache's arena (hybrid models) does not support pipeline "
            f"parallelism yet (pipeline_parallel_size {pc.pipeline_parallel_size}); tensor "
            f"parallelism is supported.{fix}")
    _refuse_context_parallel(pc, "--kv-backend ulacache's arena (hybrid models)", f" yet.{fix}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise KVBackendError("--kv-backend ulacache's arena (hybrid models) does not support "
                             f"speculative decoding yet.{fix}")
    sc = vllm_config.scheduler_config
    if sc.async_scheduling:
        # A step's pages are fenced until its output is processed; with one batch in flight
        # at a time (synchronous scheduling) the fences pass before the next schedule.
        logger.info("ulacache arena: async scheduling is turned off (hybrid models run with "
                    "synchronous scheduling under the arena for now)")
        sc.async_scheduling = False
    cc = vllm_config.cache_config
    if not getattr(cc, "user_specified_block_size", False):
        cc.block_size = ARENA_BLOCK_SIZE


def _refuse_context_parallel(pc: Any, who: str, why: str) -> None:
    for what in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(pc, what, 1) or 1) > 1:
            raise KVBackendError(f"{who} does not support {what} > 1{why}")


def shards_of(vllm_config: Any, settings: UlaSettings) -> int:
    """Ranks the logical space is split over: the TP size in shard mode, else 1."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    return tp if settings.tp_mode == "shard" and tp > 1 else 1


def check_tp_mode(vllm_config: Any, settings: UlaSettings) -> None:
    """What TP shard mode does not support yet is refused here, before any engine starts."""
    if shards_of(vllm_config, settings) == 1:
        return
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    fix = "; use --ula-tp-mode replicate (every rank holds every row) for this setup."
    if pc.pipeline_parallel_size > 1:
        raise KVBackendError(f"--ula-tp-mode shard (tensor_parallel_size {tp}) does not "
                             f"support pipeline parallelism (pipeline_parallel_size "
                             f"{pc.pipeline_parallel_size}) yet{fix}")
    _refuse_context_parallel(pc, "--ula-tp-mode shard",
                             f" (vLLM's context parallelism shards the KV itself){fix}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise KVBackendError("--ula-tp-mode shard does not support speculative decoding (MTP) "
                             "yet: rejected draft tokens rewrite their KV rows in place, which "
                             f"the remote-row buffers would serve stale{fix}")
    bs = getattr(vllm_config.cache_config, "block_size", None)
    if bs and bs % tp:
        raise KVBackendError(
            f"--ula-tp-mode shard needs block_size % tensor_parallel_size == 0 (token t lives "
            f"on rank t mod {tp}); block_size is {bs}. Pass --block-size {bs * tp} (or another "
            f"multiple of {tp}){fix}")


def check_host_pool(vllm_config: Any, settings: UlaSettings) -> None:
    """Fails in the front end (before any engine process starts) when the host pool cannot
    hold one request of max_model_len; the engine core re-checks with the exact layer specs."""
    import torch

    from .dsa.sizing import check_host_capacity, host_tokens_of

    mc = vllm_config.model_config
    text = mc.hf_text_config
    head = getattr(text, "kv_lora_rank", 0) + getattr(text, "qk_rope_head_dim", 0)
    layers = mc.get_num_layers(vllm_config.parallel_config) + _draft_kv_layers(vllm_config)
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.bfloat16
    per_token = layers * head * torch.empty((), dtype=dtype).element_size()
    if per_token <= 0:
        return
    # Whole blocks, as the engine core counts them (the block size may still change there; it
    # checks again with its own).
    bs = getattr(vllm_config.cache_config, "block_size", None) or 1
    shards = shards_of(vllm_config, settings)
    host_tokens = host_tokens_of(settings.host_pool_gib, per_token, max(1, bs // shards))
    check_host_capacity(settings.host_pool_gib, host_tokens, per_token, layers, mc.max_model_len,
                        max(1, bs // shards), shards)


def _draft_kv_layers(vllm_config: Any) -> int:
    """KV layers a speculative draft adds (an MTP module of a DSA model keeps sparse-MLA rows
    like the target's layers); 0 without a draft model (e.g. n-gram speculation)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is None or draft is vllm_config.model_config:
        return 0
    n = getattr(draft.hf_text_config, "num_nextn_predict_layers", None)
    if getattr(spec, "method", None) in ("mtp", "deepseek_mtp") and n:
        return int(n)
    return draft.get_num_layers(vllm_config.parallel_config)


def set_error_file() -> None:
    """A fresh path for engine-core errors of this engine (config.report_engine_error)."""
    import atexit
    import os
    import tempfile

    from .config import ERROR_FILE_ENV

    path = os.path.join(tempfile.gettempdir(),
                        f"ulacache-error-{os.getpid()}-{os.urandom(6).hex()}.txt")
    os.environ[ERROR_FILE_ENV] = path
    atexit.register(_remove_quietly, path)  # a message nobody read must not stay behind


def _remove_quietly(path: str) -> None:
    import os

    try:
        os.unlink(path)
    except OSError:
        pass


def keep_cpu_core_reservation(vllm_config: Any) -> None:
    """On the CPU build, vLLM reserves one extra core per rank whenever a KV connector is
    configured (meant for NIXL prefill/decode transfer threads). ulacache's connector only
    carries a list of freed blocks, so keep the reservation of an engine without a connector;
    otherwise, on small machines, the worker's OpenMP threads share every core with the
    engine-core process (measured: batch-1 decode ~2x slower on 2 cores). An explicit
    VLLM_CPU_NUM_OF_RESERVED_CPU wins. Set before the engine processes are spawned, which
    inherit it."""
    import os

    if "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return
    pc = vllm_config.parallel_config
    local_world_size = pc.tensor_parallel_size * pc.pipeline_parallel_size
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(local_world_size)
