"""The DeepSeek-V4 line: compressed sparse attention inside a hybrid cache.

Built from the two lines' parts: the CSA compressed rows in the logical address space
(`rows.py`: device and host pools per CSA layer, a `core.mapping.TieredMapping` each, the
scheduler's logical CSA block pool in `manager.py`, the kernels bound through
`patches/v4_csa_rows.py`), every other V4 cache an arena kind at its natural page size
(`sizing.py`, the arena's manager and worker extended in `manager.py` and `worker.py`).
"""
