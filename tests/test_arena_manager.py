"""The arena's scheduler side over vLLM's real per-type managers (no engine): the byte gate,
sliding-window pages going back to the arena, frees down to the null page, one fence per
step, and the worker's plan executor and block-table translation keeping every page's bytes
through compactions and relayouts, and through copies that fail or stall."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request, RequestStatus

from ulacache_vllm.engine.arena.manager import ArenaKVCacheManager
from ulacache_vllm.engine.arena.sizing import ArenaGroup, ArenaLayout
from ulacache_vllm.engine.line import UlaKVCacheConfig
from lab.arena_fuzz import Harness, check_tiling

# Manager-level runs take seconds: a hang (a reclaim loop once did) fails fast, not at
# the suite's 900 s per-test limit.
pytestmark = pytest.mark.timeout(120)

BS = 32
MAX_LEN = 512
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
SWA = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32,
                        sliding_window=64)
PAGE = FULL.page_size_bytes  # 2 KiB per layer page


def _layout(total_pages: int) -> ArenaLayout:
    groups = [ArenaGroup("sliding", "low", ("l0",), PAGE, BS, 4),
              ArenaGroup("full", "high", ("l1",), PAGE, BS, MAX_LEN // BS)]
    total = total_pages * PAGE
    return ArenaLayout(groups, PAGE, total, total + PAGE, total + PAGE, MAX_LEN)


def _manager(total_pages: int, force_moves: int = 0) -> ArenaKVCacheManager:
    layout = _layout(total_pages)
    layout.force_moves_every = force_moves
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], SWA),
                                         KVCacheGroupSpec(["l1"], FULL)])
    cfg = UlaKVCacheConfig.of(cfg, layout)
    return ArenaKVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=BS,
                               hash_block_size=BS, enable_caching=False, max_in_flight_tokens=BS)


class Engine(Harness):
    """The fuzz driver's harness (`benchmarks/lab/arena_fuzz.py`: plan to the worker, every
    page's bytes checked, new pages filled) with the requests of each step given."""

    def step(self, requests: dict[Request, int]):
        got = {}

        def schedule():
            done = {}
            for req, n in requests.items():
                got[req.request_id] = self.mgr.allocate_slots(req, n)
                if got[req.request_id] is not None:
                    req.status = RequestStatus.RUNNING
                    done[req] = n
            return done

        super().step(schedule)
        return got, self.plan

    def free(self, req):
        self.mgr.free(req)


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1000), None)


def test_byte_gate_admits_what_fits_and_frees_back_to_the_null_page():
    mgr = _manager(total_pages=40)
    eng = Engine(mgr)
    a, b = _request("a", 10 * BS), _request("b", 30 * BS)
    got, _ = eng.step({a: a.num_tokens})
    assert got["a"] is not None
    # b's whole prompt (30 full pages + its sliding pages) does not fit beside a: refused,
    # nothing allocated for it.
    used = mgr.arena.used_bytes
    got, _ = eng.step({b: b.num_tokens})
    assert got["b"] is None and mgr.arena.used_bytes == used
    eng.free(a)
    got, _ = eng.step({b: b.num_tokens})
    assert got["b"] is not None
    eng.free(b)
    assert mgr.arena.used_bytes == mgr.arena.page_bytes[0]  # the null page only
    assert mgr.stats()["arena_used_bytes"] == 0 and mgr.arena.pending_bytes == 0


def test_sliding_window_pages_go_back_to_the_arena_while_decoding():
    mgr = _manager(total_pages=64)
    eng = Engine(mgr)
    a = _request("a", 3 * BS)
    eng.step({a: a.num_tokens})
    held = []
    for _ in range(6 * BS):
        a.append_output_token_ids(7)
        eng.step({a: 1})
        held.append(mgr.stats()["arena_used_by_kind"]["sliding"] // PAGE)
    # Full attention grew by a page every 32 tokens; the window's pages stayed bounded.
    assert max(held) <= 4 and held[-1] <= 4, held
    assert mgr.stats()["arena_used_by_kind"]["full"] == 9 * PAGE


def test_every_page_a_step_places_is_fenced_by_that_step():
    """Each step's plan ships every page the step placed, and its fence covers them, also a
    window page freed and placed again under its old vid at its old offset (the table diff
    alone cannot see it) and pages placed in a step that also moved pages."""
    mgr = _manager(total_pages=64)
    eng = Engine(mgr)
    take, unfenced, reused = mgr.take_step, [], []

    def take_step():
        before = {v: int(o) for v, o in zip(*mgr.arena.live_pages()[:2])}
        plan = take()
        for off in plan.new[:, 0].tolist():
            vid = int(mgr.arena.p2v([off])[0])
            if before.get(vid) == off:
                reused.append(vid)
            if not mgr.arena.ledger.busy(off) or vid not in plan.vids.tolist():
                unfenced.append((mgr.step_seq, vid, off))
        return plan

    mgr.take_step = take_step
    a, b = _request("a", 3 * BS), _request("b", 5 * BS)
    eng.step({a: a.num_tokens, b: b.num_tokens})
    for step in range(4 * BS):
        if step % 7 == 3:
            mgr._state.record_moves(mgr.arena.compact())  # a step that also moves pages
        for r in (a, b):
            r.append_output_token_ids(7)
        eng.step({a: 1, b: 1})
    assert reused, "no window page came back under its old vid and offset"
    assert not unfenced, unfenced[:8]


@pytest.fixture(params=["gather", "slices"])
def executor(request, monkeypatch):
    """The worker's two CPU executors of a step: whole-step index ops, or a slice per range."""
    import ulacache_vllm.engine.arena.worker as aw

    monkeypatch.setattr(aw, "LOOP_MIN_BYTES", 1 << 40 if request.param == "gather" else 0)
    return request.param


def test_moves_keep_every_page_and_one_fence_per_step(executor):
    mgr = _manager(total_pages=48, force_moves=2)
    eng = Engine(mgr)
    reqs = [_request(f"r{i}", (2 + i) * BS) for i in range(5)]
    eng.step({r: r.num_tokens for r in reqs})
    copies = 0
    for step in range(40):
        live = [r for r in reqs if r.request_id in mgr.coordinator.single_type_managers[1].req_to_blocks]
        if step in (3, 11):  # holes in both bands
            eng.free(live[1])
            live.pop(1)
        for r in live:
            r.append_output_token_ids(5)
        _, plan = eng.step({r: 1 for r in live})
        copies += sum(len(s) for s in plan.copies)
    s = mgr.stats()
    assert s["arena_compactions"] > 0 and s["arena_relayouts"] > 0 and copies > 0, s
    assert eng.worker.counters["bytes_copied"] == s["arena_bytes_copied"]
    # One fence per step, each passed once the step was processed.
    assert s["arena_fences_opened"] == mgr.step_seq
    assert not [f for f in mgr.arena.ledger.open_fences() if f.label != "null page"]


def test_figures_travel_only_when_one_changes():
    """A step whose figures are the ones the worker has ships none (its plan carries the
    fence counts only); the worker's usage always reads the scheduler's figures as of the
    step's plan, and its connector stats report each shipment once (None in between)."""
    mgr = _manager(total_pages=48)
    eng = Engine(mgr)
    take, at_plan = mgr.take_step, {}

    def take_step():
        plan = take()
        now = mgr.stats()
        at_plan.update(figures={k: v for k, v in now.items() if "fences" not in k},
                       fences=(now["arena_fences_opened"], now["arena_fences_passed"]))
        assert now["arena_fences_opened"] == mgr.step_seq
        return plan

    mgr.take_step = take_step
    r = _request("r0", 2 * BS)
    shipped, worker_has, reports = [], None, 0
    for step in range(3 * BS):
        if step:
            r.append_output_token_ids(5)
        _, plan = eng.step({r: r.num_tokens if step == 0 else 1})
        if plan.stats is None:
            assert at_plan["figures"] == worker_has, step  # nothing the worker lacks
        else:
            assert {k: v for k, v in plan.stats.items()} == at_plan["figures"], step
            worker_has = at_plan["figures"]
        shipped.append(plan.stats is not None)
        u = eng.worker.usage()
        assert {k: u[k] for k in worker_has} == worker_has, step
        assert (u["arena_fences_opened"], u["arena_fences_passed"]) == plan.fences \
            == at_plan["fences"], step
        got = eng.worker.stats(0)  # (None also when the shipped figures report no change)
        assert got is None or shipped[-1], step
        reports += got is not None
        assert eng.worker.stats(0) is None  # reported once
    # The first step and the new pages' steps shipped figures; most decode steps none.
    assert 3 <= sum(shipped) <= 3 * BS // 4, shipped
    assert reports >= 3, reports  # the first allocation and two new full pages at least


def test_a_running_request_takes_vllms_steps_once(monkeypatch):
    """A running request's tokens without a hits object (the manager's own path for them)
    and with an empty one (through vLLM's ``allocate_slots``) place the same pages and give
    the same block tables, plans and figures, window frees and moves included; only the
    second runs vLLM's ``allocate_slots``."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    calls = []
    real = KVCacheManager.allocate_slots

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", spy)
    traces = {}
    for path in ("own", "vllm"):
        mgr = _manager(total_pages=48, force_moves=3)
        eng = Engine(mgr)
        reqs = [_request(f"r{i}", (2 + i) * BS + 7) for i in range(4)]
        eng.step({r: r.num_tokens for r in reqs})
        calls.clear()
        kw = {} if path == "own" else {"new_computed_blocks": mgr.empty_kv_cache_blocks}

        def schedule():
            for r in reqs:
                assert mgr.allocate_slots(r, 1, **kw) is not None
            return {r: 1 for r in reqs}

        trace = []
        for _ in range(2 * BS):
            for r in reqs:
                r.append_output_token_ids(5)
            Harness.step(eng, schedule)
            p = eng.plan
            trace.append(([mgr.get_block_ids(r.request_id) for r in reqs], p.vids.tolist(),
                          p.granules.tolist(), p.new.tolist(), [c.tolist() for c in p.copies],
                          mgr.stats()))
        traces[path] = trace
        assert len(calls) == (0 if path == "own" else 2 * BS * len(reqs))
    assert traces["own"] == traces["vllm"]
    assert any(t[4] for t in traces["own"]) and any(t[3] for t in traces["own"])


def _run_with_faults(faults, seed: int, steps: int = 36):
    """Five requests decoding with a compaction or relayout every 2 steps and holes punched
    in both bands, the worker's copies under ``faults``. Every page not reported lost keeps
    its bytes (checked each step by the engine harness); the requests holding lost pages are
    ended as the scheduler does. Returns (manager, engine, [(step, lost vids, moved vids,
    ended request ids)])."""
    from ulacache_vllm.engine.faults import MoveFaults

    rng = np.random.default_rng(seed)
    mgr = _manager(total_pages=48, force_moves=2)
    eng = Engine(mgr)
    eng.worker.faults = MoveFaults(**faults) if faults else None
    reqs = [_request(f"r{i}", int(rng.integers(2, 7)) * BS) for i in range(5)]
    eng.step({r: r.num_tokens for r in reqs})
    live = list(reqs)
    events = []
    for step in range(steps):
        if live and rng.random() < 0.12:
            eng.free(live.pop(int(rng.integers(len(live)))))
        for r in live:
            r.append_output_token_ids(5)
        _, plan = eng.step({r: 1 for r in live})
        if eng.lost:
            new = set(mgr.arena.p2v(plan.new[:, 0]).tolist())
            moved = set(plan.vids.tolist()) - new
            ended = mgr.lost_block_owners(eng.lost, live)
            for r in [r for r in live if r.request_id in ended]:
                eng.free(r)
                live.remove(r)
            events.append((step, set(eng.lost), moved, ended))
        check_tiling(mgr.arena)
    return mgr, eng, events


@pytest.mark.parametrize("seed", range(6))
def test_a_failed_copy_loses_only_moved_pages_and_ends_their_requests(seed):
    """A copy step of the worker raises (after ``skip`` good ones): the pages whose final
    bytes it spoiled are reported lost, all of them pages this step moved (never one that
    stayed put or a new one), at least one request holds them and is ended; every other page
    keeps its bytes through this and later moves, and the arena's bytes still tile exactly.
    Freed down to the null page afterwards."""
    skip = seed % 3
    mgr, eng, events = _run_with_faults(dict(fault="raise", moves=("arena",), skip=skip,
                                             count=1), seed)
    assert eng.worker.counters["failed_copy_steps"] == 1
    assert eng.worker.faults.fired == 1
    assert len(events) == 1, events
    _, lost, moved, ended = events[0]
    assert lost and lost <= moved, (lost, moved)
    assert ended
    assert eng.worker.counters["lost_pages"] == len(lost)
    for r in [r for r in mgr.coordinator.single_type_managers[1].req_to_blocks]:
        mgr.free(_ReqId(r))
    assert mgr.arena.used_bytes == mgr.arena.page_bytes[0]


class _ReqId:
    def __init__(self, rid):
        self.request_id = rid


def test_stalled_copies_change_no_byte():
    """Copies that stall (sleep first) move every page intact: nothing lost."""
    mgr, eng, events = _run_with_faults(dict(fault="stall", moves=("arena",), count=3,
                                             seconds=0.01), seed=1)
    assert eng.worker.counters["stalled_copy_steps"] == 3
    assert eng.worker.counters["failed_copy_steps"] == 0 and not events
    assert eng.worker.counters["bytes_copied"] == mgr.stats()["arena_bytes_copied"] > 0


def test_bad_bytes_follow_the_copy_chain():
    """The failure path's book of spoiled byte ranges: a failed step spoils its
    destinations; a later step that copies from them spoils its own; a good step that
    overwrites them cleans them; partial overlaps are cut exactly."""
    from ulacache_vllm.engine.arena.worker import BadBytes

    b = BadBytes()
    b.failed([(0, 100, 10)])  # [100, 110) spoiled
    b.copied([(100, 200, 10), (300, 105, 10)])  # chain on; [105, 115) overwritten with good
    assert sorted(b.spans) == [(100, 105), (200, 210)]
    b.copied([(195, 400, 10)])  # half of the source is bad
    assert sorted(b.spans) == [(100, 105), (200, 210), (405, 410)]
    assert b.within(0, 103) == [(100, 103)] and not b.within(105, 200)


@pytest.mark.parametrize("zero_new", [True, False])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_page_copied_on_from_a_failed_destination_is_lost(failing, zero_new, executor):
    """Hand-made plan, pages of 8 bytes: vid 1 goes 0 -> 16 -> 32 over two steps, vid 2
    goes 8 -> 24 in the second. Step ``failing`` raises: vid 1 is lost either way (its chain
    passes through it); vid 2 only if its own step failed; vid 3 (new) never, zeroed or not;
    its bytes are zeroed exactly when the layout says so."""
    from ulacache_vllm.engine.arena.pools import ArenaStepPlan
    from ulacache_vllm.engine.arena.worker import ArenaWorker
    from ulacache_vllm.engine.faults import MoveFaults

    lay = SimpleNamespace(buffer_bytes=64, alignment=8, zero_new_pages=zero_new)
    buf = torch.arange(64, dtype=torch.int8)
    w = ArenaWorker(lay, {"l0": buf})
    w.faults = MoveFaults("raise", moves=("arena",), skip=failing, count=1)
    plan = ArenaStepPlan(
        copies=[np.array([[0, 16, 8]]), np.array([[16, 32, 8], [8, 24, 8]])],
        vids=np.array([1, 2, 3]), granules=np.array([4, 3, 5]), sizes=np.array([8, 8, 8]),
        new=np.array([[40, 8]]))
    w.apply(plan)
    assert w.take_lost() == ({1} if failing == 0 else {1, 2})
    if failing == 0:
        assert buf[24:32].tolist() == list(range(8, 16))  # vid 2 moved intact
    assert w.counters["failed_copy_steps"] == 1
    assert w.v2g[1:4].tolist() == [4, 3, 5]
    assert buf[40:48].tolist() == ([0] * 8 if zero_new else list(range(40, 48)))
    assert w.counters["zeroed_pages"] == (1 if zero_new else 0)


def test_a_page_placed_in_a_step_in_flight_is_not_moved():
    mgr = _manager(total_pages=48)
    eng = Engine(mgr)
    a, b = _request("a", 4 * BS), _request("b", 4 * BS)
    eng.step({a: a.num_tokens, b: b.num_tokens})
    eng.free(a)  # a hole below b's pages
    mgr.new_step_starts()
    c = _request("c", BS)
    assert mgr.allocate_slots(c, c.num_tokens) is not None
    plan = mgr.take_step()  # c's pages fenced until step_processed
    c_vids = {v for ids in mgr.get_block_ids("c") for v in ids}
    before = mgr.arena.v2p(sorted(c_vids))
    mgr.arena.relayout()
    assert (mgr.arena.v2p(sorted(c_vids)) == before).all()
    mgr.step_processed(plan)
    assert not [f for f in mgr.arena.ledger.open_fences() if f.label != "null page"]


def test_block_table_translation_writes_granules_and_keeps_vids():
    mgr = _manager(total_pages=16)
    eng = Engine(mgr)
    a = _request("a", 3 * BS)
    eng.step({a: a.num_tokens})
    vids = mgr.get_block_ids("a")[1]
    cpu = torch.zeros(4, 8, dtype=torch.int32)
    cpu[0, :len(vids)] = torch.tensor(vids, dtype=torch.int32)
    table = SimpleNamespace(block_table=SimpleNamespace(cpu=cpu, gpu=cpu))  # aliased, as on CPU
    eng.worker.translate(table, 1)
    want = mgr.arena.v2p(vids) // mgr.layout.alignment
    assert table.block_table.gpu[0, :len(vids)].tolist() == want.tolist()
    assert cpu[0, :len(vids)].tolist() == list(vids)  # the host rows keep vids
    assert table.block_table.gpu.data_ptr() != cpu.data_ptr()


@pytest.mark.parametrize("what", ["pp", "dcp", "mamba2"])
def test_unsupported_hybrid_setups_are_refused_with_the_fix(what):
    from ulacache_vllm.engine import config
    from ulacache_vllm.engine.arena import sizing

    if what == "mamba2":
        from transformers import PretrainedConfig

        from ulacache_vllm.engine.lines import choose_line

        mc = SimpleNamespace(hf_config=PretrainedConfig(architectures=["NemotronHForCausalLM"]))
        with pytest.raises(config.KVBackendError, match="Qwen3NextForCausalLM.*--kv-backend vllm"):
            choose_line(mc)
        return
    pc = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                         decode_context_parallel_size=1)
    if what == "pp":
        pc.pipeline_parallel_size = 2
        match = "pipeline_parallel_size 2.*--kv-backend vllm"
    else:
        pc.decode_context_parallel_size = 2
        match = "decode_context_parallel_size > 1.*--kv-backend vllm"
    with pytest.raises(config.KVBackendError, match=match):
        sizing.prepare(SimpleNamespace(parallel_config=pc), config.UlaSettings())


def test_new_pages_are_zeroed_by_vllms_rule():
    """The arena zeroes new pages where vLLM zeroes its own blocks: with Mamba state or KV of
    two precisions sharing the bytes, not for attention kinds of one precision."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from ulacache_vllm.engine.arena.sizing import needs_zeroing

    half = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    state = MambaSpec(block_size=MAX_LEN, shapes=((3, 256),), dtypes=(torch.float32,))
    assert not needs_zeroing([(["l0"], SWA), (["l1"], FULL)])
    assert needs_zeroing([(["l0"], SWA), (["l1"], half)])
    assert needs_zeroing([(["l0"], state), (["l1"], FULL)])
