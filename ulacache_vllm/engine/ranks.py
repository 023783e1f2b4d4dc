"""Where this worker sits in its engine (vLLM's parallel groups), for the lines' workers."""
from __future__ import annotations


def tp_rank() -> int:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tp_group().rank_in_group
    except AssertionError:  # groups not initialised (single-process tests)
        return 0


def first_worker_of_engine() -> bool:
    """TP / PP rank 0: the one worker of an engine that writes the trace (the others would
    record the same rounds into the same file)."""
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tp_group().rank_in_group == 0 and ps.get_pp_group().rank_in_group == 0
    except AssertionError:  # groups not initialised (single-process tests)
        return True
