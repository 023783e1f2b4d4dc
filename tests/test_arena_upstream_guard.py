"""The arena manager's copy of vLLM's `allocate_slots` steps is tied to the upstream method it
copies: another vLLM (or another body) fails loudly instead of running stale steps."""
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
