"""Property-based fuzz of the arena: admit / grow / shrink / free / compact / relayout / fences,
with every copy plan applied to a real byte tensor."""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ._model import Shadow, demand_fits_reference
from ulacache_vllm.arena import Arena, Band, KindSpec, RowSpec

ALIGN = 16


def make_kinds(full_rows: int, swa_tokens: int, state_bytes: int) -> list[KindSpec]:
    return [
        # Target KV beside draft KV in one entry: rows of different shape and dtype.
        KindSpec("full", Band.HIGH, (RowSpec("target", (2, full_rows), "bfloat16"),
                                     RowSpec("draft", (3,), "float32")), entries_per_page=4),
        KindSpec("swa", Band.LOW, (RowSpec("kv", (4,), "bfloat16"),), entries_per_page=swa_tokens),
        KindSpec("state", Band.LOW, (RowSpec("conv", (state_bytes,), "uint8"),
                                     RowSpec("ssm", (2, 2), "float32")), entries_per_page=1),
    ]


class ArenaMachine(RuleBasedStateMachine):
    @initialize(full_rows=st.integers(1, 12), swa_tokens=st.integers(2, 16),
                state_bytes=st.integers(1, 150), pages=st.integers(4, 16), seed=st.integers(0, 99))
    def setup(self, full_rows, swa_tokens, state_bytes, pages, seed):
        kinds = make_kinds(full_rows, swa_tokens, state_bytes)
        total = pages * max(k.page_bytes(ALIGN) for k in kinds)
        self.arena = Arena(total, kinds, alignment=ALIGN)
        self.shadow = Shadow(self.arena, seed)
        self.next_id = 0
        self.fences = []

    # -- helpers --------------------------------------------------------------------------------
    def _layout(self):
        vids, offs, _ = self.arena.live_pages()
        return vids.tolist(), offs.tolist(), self.arena.free_extents(), self.arena.band_bounds

    def _after(self, res, demands: dict[int, int], before) -> None:
        a = self.arena
        if not res.ok:  # a shortfall changes nothing: no moves, no plan
            assert not res.copy_plan and self._layout() == before
        self.shadow.apply(res.copy_plan)
        event(f"ladder step: {res.step}")
        if len(res.copy_plan.steps) > 1:
            event("multi-step copy plan")
        if res.ok:
            for k, n in demands.items():
                assert len(res.vids[a.kinds[k].name]) == n
            self.shadow.write_new(res.vids)
            return
        need = sum(n * a.page_bytes[k] for k, n in demands.items())
        assert res.shortfall_bytes > 0
        if need > a.free_bytes:
            return
        # Enough free bytes, yet refused: only fences may be in the way ...
        assert a.ledger.open_fences() or a.pending_bytes, "shortfall with room and no fences"
        # ... no placement exists among the free extents after the whole ladder ...
        assert not demand_fits_reference(a, demands)
        # ... and once every fence passes the same demand fits.
        twin = copy.deepcopy(a)
        for f in twin.ledger.open_fences():
            f.complete()
        if need <= twin.free_bytes:
            assert twin.admit(("twin",), {a.kinds[k].name: n for k, n in demands.items()}).ok

    def _requests(self):
        return self.arena.requests()

    # -- rules ----------------------------------------------------------------------------------
    @rule(n_full=st.integers(0, 6), n_swa=st.integers(0, 4), n_state=st.integers(0, 1))
    def admit(self, n_full, n_swa, n_state):
        dem = {0: n_full, 1: n_swa, 2: n_state}
        rid = self.next_id
        self.next_id += 1
        before = self._layout()
        self._after(self.arena.admit(rid, {"full": n_full, "swa": n_swa, "state": n_state}), dem,
                    before)

    @rule(data=st.data(), kind=st.integers(0, 2), n=st.integers(1, 4))
    def grow(self, data, kind, n):
        if not self._requests():
            return
        rid = data.draw(st.sampled_from(self._requests()))
        before = self._layout()
        self._after(self.arena.grow(rid, kind, n), {kind: n}, before)

    @rule(data=st.data(), kind=st.integers(0, 2))
    def shrink(self, data, kind):
        if not self._requests():
            return
        rid = data.draw(st.sampled_from(self._requests()))
        held = self.arena.pages(rid, kind).tolist()
        if not held:
            return
        drop = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        self.arena.shrink(rid, kind, drop)
        self.shadow.forget(drop)

    @rule(data=st.data())
    def free(self, data):
        if not self._requests():
            return
        rid = data.draw(st.sampled_from(self._requests()))
        vids = [v for k in range(3) for v in self.arena.pages(rid, k).tolist()]
        self.arena.free(rid)
        self.shadow.forget(vids)

    @rule()
    def compact(self):
        self.shadow.apply(self.arena.compact())

    @rule()
    def relayout(self):
        self.shadow.apply(self.arena.relayout())

    @rule(data=st.data(), polled=st.booleans())
    def fence_pages(self, data, polled):
        if not self._requests():
            return
        rid = data.draw(st.sampled_from(self._requests()))
        vids = [v for k in range(3) for v in self.arena.pages(rid, k).tolist()]
        if not vids:
            return
        some = data.draw(st.lists(st.sampled_from(vids), min_size=1, max_size=4))
        flag = {"done": False}
        fence = self.arena.fence("step", query=(lambda: flag["done"]) if polled else None)
        self.shadow.register(some, fence)
        self.fences.append((fence, flag))

    @rule(data=st.data())
    def pass_fence(self, data):
        if not self.fences:
            return
        fence, flag = self.fences.pop(data.draw(st.integers(0, len(self.fences) - 1)))
        before = self.arena.free_bytes
        if fence.query is not None:
            flag["done"] = True
            self.arena.ledger.poll()
        else:
            fence.complete()
        assert fence.passed and self.arena.free_bytes >= before

    @rule()
    def free_everything(self):
        for rid in list(self.arena.requests()):
            self.arena.free(rid)
        assert self.arena.pending_bytes == 0 or self.fences
        for fence, _ in self.fences:
            fence.complete()
        self.fences.clear()
        self.shadow.expect.clear()
        a = self.arena
        assert a.free_bytes == a.total_bytes and a.pending_bytes == 0
        assert a.free_extents() == [(0, a.total_bytes)]
        assert a.band_bounds == (0, a.total_bytes)
        assert len(a._ids) == 0

    @invariant()
    def invariants(self):
        if hasattr(self, "shadow"):
            self.shadow.check()


ArenaMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestArenaFuzz = ArenaMachine.TestCase
