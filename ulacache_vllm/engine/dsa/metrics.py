"""The DSA line's Prometheus series (`vllm:ulacache_<name>`): its workers' counters
(`counters.StoreCounters`, as increments) and pool gauges (`store.UlaWorkerStore.usage`)."""
from __future__ import annotations

from ..line import LineMetrics

METRICS = LineMetrics(
    counters={
        "lookups": "Sparse-MLA KV entries looked up by the indexer's top-k (deduplicated).",
        "hits": "Looked-up entries already resident in the device pool.",
        "promotions": "Entries moved host -> device.",
        "deferred": "Looked-up host entries left on the host (read there) because they were "
                    "not read in --ula-promote-after steps in a row.",
        "demotions": "Entries moved device -> host (PB-LRU victims).",
        "bytes_moved": "Bytes copied between the device and host pools.",
        "fallback_chunks": "Settles that promoted only part of a step's working set (it "
                           "exceeded the device pool; the rest stays on the host and is "
                           "staged when read).",
        "fast_path_exits": "Switches from identity placement (no translation) to mapped "
                           "placement.",
        "replica_exits": "TP shard mode: switches from replicated rows (while everything fits "
                         "one rank) to shards.",
        "remote_lookups": "TP shard mode: unique remote (other ranks') entries read, per read.",
        "remote_hits": "TP shard mode: remote entries read from the buffer of recently fetched "
                       "rows.",
        "remote_rows_fetched": "TP shard mode: rows fetched from their owner ranks (per layer).",
        "remote_bytes_fetched": "TP shard mode: bytes of rows fetched from their owner ranks.",
        "remote_fill_skips": "TP shard mode: steps (per layer group) that left the remote-row "
                             "buffer as it was because reads seldom hit it "
                             "(--ula-remote-buffer-min-hit-rate).",
        "failed_copies": "Tier row copies in the worker's move path that failed; the requests "
                         "whose KV they lost ended with an error.",
        "prefix_hit_entries": "Prefix-cache hits: entries of cached blocks a new request took "
                              "over (per layer group).",
        "prefix_hit_entries_host": "Prefix-cache hits whose entries sat in the host tier when "
                                   "the request took them over (read from there; promoted "
                                   "once attention selects them in --ula-promote-after steps "
                                   "in a row).",
    },
    gauges={
        "device_used": "Device-pool slots in use (summed over layer groups).",
        "host_used": "Host-pool slots in use (summed over layer groups).",
        "device_capacity": "Device-pool slots (summed over layer groups).",
        "host_capacity": "Host-pool slots (summed over layer groups).",
        "remote_used": "TP shard mode: remote-row buffer slots in use (summed over groups).",
        "remote_capacity": "TP shard mode: remote-row buffer slots (summed over groups).",
    },
)
