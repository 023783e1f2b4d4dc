"""The arena manager's copy of vLLM's `allocate_slots` steps is tied to the upstream method it
copies: another vLLM (or another body) fails loudly instead of running stale steps. So is
ulacache's scheduler's override of vLLM's align-mode prefill split (the GDN models' coarse
state checkpoint, issue 45), whose cut, stop and checkpoint size are checked here too."""
from __future__ import annotations

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager

from ulacache_vllm.engine.arena import manager
from ulacache_vllm.patches._hook import VllmHookError


def test_the_installed_vllm_is_the_one_copied():
    manager.check_upstream_allocate_slots()


def test_a_changed_upstream_body_or_version_fails_loudly(monkeypatch):
    def allocate_slots(self, request, num_new_tokens):  # another body
        return None

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    with pytest.raises(VllmHookError, match="_allocate_running"):
        manager.check_upstream_allocate_slots()
    monkeypatch.undo()
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(VllmHookError, match="0.33.0"):
        manager.check_upstream_allocate_slots()


@pytest.mark.parametrize("kw", [{"reserved_blocks": 2}, {"skip_zeroing_group_ids": (1,)},
                                {"num_external_computed_tokens": 16}])
def test_async_load_arguments_are_refused_not_dropped(kw):
    from types import SimpleNamespace

    m = manager.ArenaKVCacheManager.__new__(manager.ArenaKVCacheManager)
    m._state = SimpleNamespace(owner=None)  # (the refusal comes before any manager state)
    with pytest.raises(NotImplementedError, match="external KV"):
        m.allocate_slots(SimpleNamespace(request_id="r"), 16, **kw)


def test_the_checkpoint_split_hook_is_vllms_and_a_moved_one_fails_loudly(monkeypatch):
    """ulacache's scheduler overrides `Scheduler._mamba_block_aligned_split` (issue 45's coarse
    GDN state checkpoint): tied to the installed method's parameters and vLLM's version."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from ulacache_vllm.patches import mamba_checkpoint_split as hook

    hook.check()

    def moved(self, request, num_new_tokens):  # another signature
        return num_new_tokens

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", moved)
    with pytest.raises(VllmHookError, match="_mamba_block_aligned_split"):
        hook.check()


@pytest.mark.parametrize("computed,local,n,stop,want", [
    (0, 0, 3008, 2560, 2560),  # a prompt's first chunk ends at the coarse checkpoint
    (2560, 0, 448, 2560, 448),  # the chunk starting there: vLLM's
    (0, 2560, 489, 2560, 489),  # a sibling hitting it: vLLM's
    (0, 0, 2560, 2560, 2560),  # vLLM already ends there
    (0, 0, 1024, 2560, 1024),  # the stop is past this chunk
    (0, 0, 3008, 0, 3008),  # no stop (any line but the arena's GDN models)
])
def test_the_split_cuts_vllms_chunk_only_at_a_stop_inside_it(computed, local, n, stop, want):
    from types import SimpleNamespace

    from ulacache_vllm.patches.mamba_checkpoint_split import split

    calls = []

    def orig(request, num_new_tokens, num_local, num_external):
        calls.append((num_new_tokens, num_local, num_external))
        return n  # vLLM's chunk

    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(
        prefill_split_block=lambda: 0, prefill_checkpoint_stop=lambda request: stop))
    request = SimpleNamespace(num_computed_tokens=computed)
    assert split(orig, sched, request, 4096, local, 0) == want
    assert calls == [(4096, local, 0)]


def _split_scheduler(block: int, split_block: int = 0, budget: int = 4096):
    from types import SimpleNamespace as NS

    return NS(cache_config=NS(block_size=block), block_size=block, hash_block_size=block,
              mamba_partial_cache_hit=False, use_eagle_block_drop=False,
              mamba_has_prefill_checkpoint_blocks=False,
              mamba_prefill_checkpoint_alignment=None, max_num_scheduled_tokens=budget,
              scheduler_config=NS(long_prefill_token_threshold=0),
              mamba_shared_prefix_checkpoint=False,
              kv_cache_manager=NS(prefill_split_block=lambda: split_block,
                                  prefill_checkpoint_stop=lambda request: 2560))


@pytest.mark.parametrize("prompt,computed,n,junction", [
    (3049, 0, 3049, 0),  # a prompt's first chunk: stock's coarse checkpoint, not floor32
    (3049, 2560, 489, 0),  # its last chunk: to the prompt's end (no 32-token replay stop)
    (3040, 0, 3040, 3000),  # a learnt junction: block-floored at stock's block
    (3040, 2976, 64, 3000),  # a hit past stock's boundary: to the end
    (9000, 0, 4096, 0),  # a budget-bound chunk: floored at stock's block
    (3049, 0, 1000, 0),
])
def test_the_split_at_stocks_block_ends_chunks_where_stocks_split_does(prompt, computed, n,
                                                                       junction):
    """The arena's GDN models (32-token pages) split a prefill exactly as stock's 640-token
    blocks do (issue 45): vLLM's own split, run at stock's block."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.scheduler import Scheduler

    from ulacache_vllm.patches.mamba_checkpoint_split import split

    vllm_split = Scheduler._mamba_block_aligned_split
    request = SimpleNamespace(num_computed_tokens=computed, num_prompt_tokens=prompt,
                              num_tokens=prompt, shared_prefix_boundary=junction)
    stock = vllm_split(_split_scheduler(640), request, n)
    arena = _split_scheduler(32, 640)
    assert split(vllm_split.__get__(arena), arena, request, n) == stock
    # (vLLM's own split at 32-token blocks ends elsewhere: its fine replay stop)
    if (prompt, computed, n) == (3049, 0, 3049):
        assert vllm_split(_split_scheduler(32), request, n) == 3040 != stock == 2560
    # A budget below stock's block: vLLM's chunk, cut only at the coarse checkpoint.
    small = _split_scheduler(32, 640, budget=512)
    assert split(vllm_split.__get__(small), small, request, min(n, 512)) == \
        min(vllm_split(small, request, min(n, 512)), max(2560 - computed, 0) or 10**9)


def test_the_coarse_state_checkpoint_is_stocks_last_cacheable_block():
    from ulacache_vllm.engine.arena.pools import state_checkpoint

    assert state_checkpoint(3040, 640, False) == 2560
    assert state_checkpoint(3049, 640, False) == 2560
    assert state_checkpoint(2561, 640, False) == 2560
    assert state_checkpoint(2560, 640, False) == 1920  # (the last token is recomputed)
    assert state_checkpoint(3040, 0, False) == 0


def test_the_arena_checkpoints_gdn_state_at_stocks_block():
    """Stock's CPU block for a GDN hybrid (the smallest multiple of 128 tokens whose attention
    page holds a state page): 640 tokens on the tiny Qwen3-Next's shapes; none where that
    block is no coarser than the state page or without state layers."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from ulacache_vllm.engine.arena.sizing import state_checkpoint_tokens

    state = MambaSpec(shapes=((3, 1024), (4, 128, 128)), dtypes=(torch.bfloat16, torch.float32),
                      block_size=32)  # 268,288 B: tiny Qwen3-Next's GDN layer
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert state_checkpoint_tokens([(["l0", "l1", "l2"], state), (["l3"], full)]) == 640
    assert state_checkpoint_tokens([(["l3"], full)]) == 0
    wide = MambaSpec(shapes=state.shapes, dtypes=state.dtypes, block_size=1024)
    assert state_checkpoint_tokens([(["l0"], wide), (["l3"], full)]) == 0


def test_the_running_state_hook_is_vllms_and_a_changed_one_fails_loudly(monkeypatch):
    """The arena's GDN managers keep a decoding request's state in its page past the prompt
    (issue 45), repeating vLLM's align-mode bookkeeping: tied to the installed methods'
    sources and vLLM's version; a manager that is not align mode, has speculative blocks or
    another retention keeps vLLM's methods."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from ulacache_vllm.patches import mamba_running_state as hook

    hook.check()
    mgr = SimpleNamespace(mamba_cache_mode="align", num_speculative_blocks=1,
                          has_prefill_checkpoint_blocks=False)
    assert not hook.install(mgr, 0) and not hasattr(mgr, "allocate_new_blocks")
    mgr.num_speculative_blocks = 0
    assert not hook.install(mgr, None) and not hook.install(mgr, 640)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return []  # another body

    monkeypatch.setattr(MambaManager, "allocate_new_blocks", allocate_new_blocks)
    with pytest.raises(VllmHookError, match="allocate_new_blocks"):
        hook.check()


def test_the_same_step_hit_rule_at_stocks_block_is_vllms_and_a_changed_one_fails_loudly(
        monkeypatch):
    """The arena's GDN managers defer a second same-step hit of a prefix state as stock's do
    at its block (issue 45), repeating vLLM's rule: tied to the sources of the code it
    repeats and vLLM's version; a manager that is not align mode, or a checkpoint block that
    is the manager's own block, keeps vLLM's methods."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from ulacache_vllm.patches import mamba_same_step_hit as hook

    hook.check()
    mgr = SimpleNamespace(mamba_cache_mode="none", block_size=32)
    assert not hook.install(mgr, 640) and not hasattr(mgr, "cache_blocks")
    mgr.mamba_cache_mode = "align"
    assert not hook.install(mgr, 0) and not hook.install(mgr, 32)
    assert not hook.install(mgr, 48) and not hasattr(mgr, "cache_blocks")

    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        return None  # another body

    monkeypatch.setattr(MambaManager, "_cache_partial_tail_block", _cache_partial_tail_block)
    with pytest.raises(VllmHookError, match="_cache_partial_tail_block"):
        hook.check()


def test_an_align_copy_of_a_page_onto_itself_is_dropped():
    """A relocated running state's align copy (its page onto itself) leaves vLLM's copy list;
    the other entries keep their order."""
    from types import SimpleNamespace

    import numpy as np

    from ulacache_vllm.patches.mamba_align_translate import _drop_self_copies

    arr = lambda *v: SimpleNamespace(np=np.array([*v, 0, 0], np.int64))  # noqa: E731
    bufs = SimpleNamespace(src_ptrs=arr(9, 10, 20, 30), dst_ptrs=arr(9, 11, 20, 31),
                           sizes=arr(1, 2, 3, 4), offset=4)
    _drop_self_copies(bufs, 1)
    assert bufs.offset == 3
    assert bufs.src_ptrs.np[:3].tolist() == [9, 10, 30]
    assert bufs.dst_ptrs.np[:3].tolist() == [9, 11, 31] and bufs.sizes.np[:3].tolist() == [1, 2, 4]
