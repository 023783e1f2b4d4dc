"""Hook: `EngineArgs.create_engine_config` (engine/arg_utils.py).

The single place where a `kv_backend` request, from any entry point (CLI flag, `LLM` keyword,
raw `--additional-config`), is validated and turned into vLLM configuration: an unknown name or
an unsupported model fails here, in the front-end process, with a message naming the fix,
instead of as a traceback deep inside the engine core. Here the product line is chosen for the
model and recorded in `additional_config` (`wiring.prepare_engine_args`), before vLLM builds
the configuration every other process reads it from.
"""
from __future__ import annotations

from ulacache_vllm.engine import config as ula_config

from . import cpu_mla_path
from ._hook import replace

HOOK = "engine_config"
MODULE = "vllm.engine.arg_utils"


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        backend = ula_config.backend_from_additional_config(self.additional_config)
        settings = None
        if backend == "ulacache":
            settings = ula_config.settings_from_additional_config(self.additional_config)
            from ulacache_vllm.engine import wiring

            wiring.prepare_engine_args(self, settings)
        cpu_mla_path.record_requests(self)
        vllm_config = orig(self, *args, **kwargs)
        if backend == "ulacache":
            wiring.finalize_vllm_config(vllm_config, settings)
        return vllm_config

    replace(MODULE, "EngineArgs.create_engine_config", create_engine_config, HOOK)
