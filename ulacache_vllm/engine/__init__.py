"""vLLM-facing code of `--kv-backend ulacache`, by product line.

- `dsa/`: the logical address space for index-based sparse-attention (DSA) models of the
  V3.2 generation: its `Line` (`line.py`), metrics, the scheduler's manager, sizing, the worker
  store and its translator, TP shard mode, the trace, and the CPU sparse-MLA backend the
  translator plugs into.
- `arena/`: the unified arena for hybrid models: its `Line`, metrics, the scheduler's manager,
  sizing, the worker.
- The glue the lines share, which names no line: `plugin` (vLLM's entry point), `config` (the
  settings table), `line` (the one protocol between the glue and a line: `Line` and the
  layout / manager / worker hooks, with defaults), `lines` (the list of lines and the one
  function that chooses a line from the model config; the choice is recorded in
  `additional_config`), `wiring` (engine arguments -> vLLM configuration), `connector`
  (scheduler -> worker channel), `scheduler`, `metrics`, `faults` (test-only copy-fault
  injection), `ranks`, `worker_ext` (inspection RPC).
"""
