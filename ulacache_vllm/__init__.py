"""ulacache_vllm: a vLLM 0.32.0 KV-cache backend.

Unified logical KV address space across device and host memory for index-based sparse
attention (DSA) models, PB-LRU eviction, and a unified arena for hybrid models. Selected with
``vllm serve MODEL --kv-backend ulacache`` or ``LLM(model, kv_backend="ulacache")``.
"""

__version__ = "0.1.0"
