"""vLLM-facing code: plugin entry, config, KV cache manager, scheduler, connector, CPU sparse-MLA backend."""
