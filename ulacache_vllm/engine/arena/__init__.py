"""The arena product line: one byte arena per rank for hybrid models (full attention, sliding
window, recurrent state), engine side of `ulacache_vllm.arena`.

`sizing` (the engine core's KV cache config: the arena's layout), `manager` (the scheduler's
KV cache manager: vLLM's per-kind managers over arena pages, one step plan per step),
`worker` (applies a step's plan to the KV tensors and translates block tables).
"""
