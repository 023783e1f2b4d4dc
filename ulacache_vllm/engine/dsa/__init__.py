"""The DSA product line: the logical address space for index-based sparse-attention models.

Scheduler side: `manager` (vLLM's KV cache manager over the logical block pool). Sizing in the
engine core: `sizing` (device + host pools, the layout the worker builds from). Worker side:
`store` (pools, mapping tables, the pre-forward half of the worker contract), `moves`
(its copies between tiers and failed copies), `translator`
(the forward half: resolve, stage, writes), `tp_shard` (token sharding and the TP exchange),
`trace`. The CPU sparse-MLA backend the translator plugs into: `cpu_sparse_mla`,
`cpu_indexer`, `sparse_math`, `topk`, `kv_translation`.
"""
