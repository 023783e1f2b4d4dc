"""The product lines of `--kv-backend ulacache`, and the one place a line is chosen.

`LINES` lists every line (`line.Line` objects, each from its package); adding a line means
adding its package and one entry here. `choose_line` picks the line from the model config,
once, in the front end (`wiring.prepare_engine_args`), which records its name in
`additional_config` (`LINE_KEY`); every vLLM process reads it back with `recorded_line`, so
the glue and the patches never name a line. Patches that act by model under any KV backend
(the CPU sparse-attention support a line's models need) ask `line_serving`.
"""
from __future__ import annotations

from typing import Any

from .arena.line import LINE as ARENA
from .config import KVBackendError, kv_backend_of
from .dsa.line import LINE as DSA
from .line import CpuSparseAttention, Line
from .v4.line import LINE as V4

# In order: the first line that serves a model gets it.
LINES: tuple[Line, ...] = (V4, DSA, ARENA)
LINE_KEY = "ulacache_line"  # additional_config: the chosen line's name


def choose_line(model_config: Any, lines: tuple[Line, ...] = LINES) -> Line:
    """The line serving this model; a KVBackendError naming the model and what each line
    serves (or a line's own refusal of a model it recognises) otherwise."""
    hf_config = model_config.hf_config
    for line in lines:
        msg = line.refusal(hf_config)
        if msg:
            raise KVBackendError(msg)
    line = line_serving(hf_config, lines)
    if line is not None:
        return line
    archs = hf_config.architectures or [type(hf_config).__name__]
    raise KVBackendError(
        f"--kv-backend ulacache does not support model architecture {', '.join(archs)}: it "
        f"serves {'; and '.join(line.serves_text for line in lines)}. Use --kv-backend vllm "
        f"for this model.")


def line_serving(hf_config: Any, lines: tuple[Line, ...] = LINES) -> Line | None:
    """The line that serves this model (no line refusing it), or None."""
    for line in lines:
        if line.refusal(hf_config) is None and line.serves(hf_config):
            return line
    return None


def record_line(additional_config: dict | None, line: Line) -> dict:
    return {**(additional_config or {}), LINE_KEY: line.name}


def line_named(name: str, lines: tuple[Line, ...] = LINES) -> Line:
    for line in lines:
        if line.name == name:
            return line
    raise KVBackendError(f"unknown ulacache line {name!r} in additional_config[{LINE_KEY!r}]; "
                         f"lines: {', '.join(line.name for line in lines)}")


def recorded_line(vllm_config: Any, lines: tuple[Line, ...] = LINES) -> Line | None:
    """The line recorded for this engine; None unless it runs `--kv-backend ulacache`."""
    if kv_backend_of(vllm_config) != "ulacache":
        return None
    name = (vllm_config.additional_config or {}).get(LINE_KEY)
    if name is None:
        raise RuntimeError(
            f"ulacache: no line recorded in additional_config[{LINE_KEY!r}] (the line is "
            "chosen where EngineArgs.create_engine_config builds the configuration; this "
            "VllmConfig was built another way)")
    return line_named(name, lines)


def cpu_sparse_attention_for(model_config: Any,
                             lines: tuple[Line, ...] = LINES) -> CpuSparseAttention | None:
    """The CPU sparse-attention support of the line serving this model (any KV backend), or
    None: vLLM's own code runs it."""
    if model_config is None:
        return None
    line = line_serving(model_config.hf_config, lines)
    return line.cpu_sparse_attention() if line is not None else None
