"""The DSA product line: the logical address space for index-based sparse-attention models.

Scheduler side: `manager` (vLLM's KV cache manager over the logical block pool). Sizing in the
engine core: `sizing` (device + host pools, the layout the worker builds from). Worker side, in
import order: `layout` (the sizing's figures), `state` (layer groups, the store's shared
record), `rows` (the device and host pools), `moves` (copies between tiers, failed copies),
`sharded_rows` (TP shard mode's remote rows), `residency` (settle, promotions, demotions,
write slots), `translator` (the forward half: resolve, stage, writes), `store` (the parts
composed: the pre-forward half of the worker contract), `tp_shard` (token sharding and the TP
exchange), `trace`. The indexer's scores: `indexer_scores`. The CPU sparse-MLA backend the translator plugs into: `cpu_sparse_mla`,
`cpu_indexer`, `sparse_math`, `topk`, `kv_translation`.
"""
