"""vLLM-facing code of `--kv-backend ulacache`, by product line.

- `dsa/`: the logical address space for index-based sparse-attention (DSA) models: the
  scheduler's manager, sizing, the worker store and its translator, TP shard mode, the trace,
  and the CPU sparse-MLA backend the translator plugs into.
- `arena/`: the unified arena for hybrid models: the scheduler's manager, sizing, the worker.
- The glue both lines share: `plugin` (vLLM's entry point), `config` (the settings table),
  `wiring` (engine arguments -> vLLM configuration; decides the line), `line` (the one
  protocol between the glue and a line, with default hooks), `connector` (scheduler -> worker
  channel), `scheduler`, `metrics`, `faults` (test-only copy-fault injection), `worker_ext`
  (inspection RPC).
"""
