"""Hook: `wait_for_engine_startup` (vllm/v1/engine/utils.py).

An engine core that refuses the ulacache configuration (sizes only the core can compute, e.g.
a device pool too small for one step) leaves its message in a file
(`engine.config.report_engine_error`); vLLM's front end only says "Engine core initialization
failed. See root cause above", some 60 log lines below it. Here the front end raises the
ulacache message itself, for `vllm serve`, `LLM(...)` and any other client alike, and removes
the file.
"""
from __future__ import annotations

from ulacache_vllm.engine import config as ula_config

from ._hook import replace

HOOK = "engine_startup_error"
MODULE = "vllm.v1.engine.utils"


def apply() -> None:
    import vllm.v1.engine.utils as utils

    orig = utils.wait_for_engine_startup

    def wait_for_engine_startup(*args, **kwargs):
        try:
            return orig(*args, **kwargs)
        except RuntimeError:
            msg = ula_config.take_engine_error()
            if msg:
                # The core's own log keeps the traceback; the front end states the fix.
                raise ula_config.KVBackendError(msg) from None
            raise

    replace(MODULE, "wait_for_engine_startup", wait_for_engine_startup, HOOK)
