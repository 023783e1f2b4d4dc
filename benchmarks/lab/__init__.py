"""The lab: what the benchmarks compare against and the tools they use, kept out of the
installed package (``--kv-backend ulacache`` never runs it): the queue and bitmap PB-LRUs, the
linked-list exact LRU, the DSA trace generator / loader / replayer, and a row store for tests.
Benchmarks run beside it (``benchmarks/`` on ``sys.path``); so do the tests (conftest)."""
