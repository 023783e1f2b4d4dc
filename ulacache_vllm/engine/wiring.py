"""Turns `kv_backend=ulacache` into vLLM configuration: connector, scheduler class, checks, and
the product line (chosen once here, `lines.choose_line`, and recorded in `additional_config`)."""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from ulacache_vllm.core.policies import POLICIES

from .config import KVBackendError, UlaSettings, refuse_kv_offloading
from .lines import choose_line, record_line, recorded_line

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
    refuse_kv_offloading(engine_args)
    ktc = engine_args.kv_transfer_config
    if ktc is not None and ktc.kv_connector not in (None, CONNECTOR_NAME):
        raise KVBackendError(
            f"--kv-backend ulacache brings its own KV connector and cannot be combined with "
            f"--kv-transfer-config {ktc.kv_connector!r} yet; drop one of them."
        )
    # A row copy that fails in the worker's move path is reported as lost blocks; "fail" ends
    # the requests that own them with an error (never a silent recompute over lost rows).
    engine_args.kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME, kv_role="kv_both", kv_connector_module_path=MODULE_PATH,
        kv_load_failure_policy="fail")
    # The product line, chosen once from the model and recorded for every vLLM process; what
    # it sets before vLLM derives the rest of its configuration from the arguments.
    line = choose_line(engine_args.create_model_config())
    engine_args.additional_config = record_line(engine_args.additional_config, line)
    line.prepare_engine_args(engine_args)
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
    """Runs after VllmConfig is built, with the line recorded by `prepare_engine_args`."""
    line = recorded_line(vllm_config)
    # A non-CPU platform is refused unless the line runs on CUDA behind the experimental
    # opt-in (`config.EXPERIMENTAL_CUDA_ENV`), whose configuration checks then run.
    line.check_platform(vllm_config)
    line.prepare(vllm_config, settings)
    keep_cpu_core_reservation(vllm_config)
    set_error_file()
    sc = vllm_config.scheduler_config
    sc.scheduler_cls = ASYNC_SCHEDULER if sc.async_scheduling else SYNC_SCHEDULER


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
