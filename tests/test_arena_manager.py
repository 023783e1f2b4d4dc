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

    traces = {}
    for path in ("own", "vllm"):
        mgr = _manager(total_pages=48, force_moves=3)
        # (after the manager's check that vLLM's allocate_slots is the one it copies)
        monkeypatch.setattr(KVCacheManager, "allocate_slots", spy)
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
        monkeypatch.setattr(KVCacheManager, "allocate_slots", real)
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


# ---------------------------------------------------------------- prefix cache under pressure
# The shape of issue 45 scaled down: a 128-token window beside full attention, one layer each
# (2 KiB pages of 32 tokens), prefixes of ~20 pages shared by siblings, 4 requests at a time.
CW = 128
CMAX = 1024  # max_model_len of this section


def _specs(block: int):
    full = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=8,
                            dtype=torch.float32, sliding_window=CW)
    return [KVCacheGroupSpec(["l0"], swa), KVCacheGroupSpec(["l1"], full)]


def _arena_cache(total_bytes: int, watermark: float = 0.0) -> ArenaKVCacheManager:
    groups = [ArenaGroup("sliding", "low", ("l0",), PAGE, BS, CW // BS + 2),
              ArenaGroup("full", "high", ("l1",), PAGE, BS, CMAX // BS)]
    total = total_bytes // PAGE * PAGE
    layout = ArenaLayout(groups, PAGE, total, total + PAGE, total + PAGE, CMAX)
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=_specs(BS), prefix_cache_retention_interval=0)
    return ArenaKVCacheManager(UlaKVCacheConfig.of(cfg, layout), max_model_len=CMAX,
                               scheduler_block_size=BS, hash_block_size=BS, enable_caching=True,
                               max_in_flight_tokens=CMAX, log_stats=True, watermark=watermark)


def _stock_cache(total_bytes: int, block: int):
    """vLLM's own manager with the same bytes: one block id holds one group's page."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    cfg = KVCacheConfig(num_blocks=total_bytes // (PAGE * block // BS) + 1,
                        kv_cache_tensors=[], kv_cache_groups=_specs(block),
                        prefix_cache_retention_interval=0)
    return KVCacheManager(cfg, max_model_len=CMAX, scheduler_block_size=block,
                          hash_block_size=block, enable_caching=True,
                          max_in_flight_tokens=CMAX, log_stats=True)


def _hashed(tokens: list[int], rid: str, block: int = BS) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1000), None,
                   block_hasher=get_request_block_hasher(block, sha256))


def _serve(mgr, waves, out_len: int = 6, max_running: int = 4, block: int = BS) -> list[int]:
    """vLLM's scheduler for whole-prompt prefills, wave by wave: first come first served
    admissions (prefix lookup first) up to ``max_running`` at once, one token a step for the
    running ones, freed when done. Returns each admission's hit tokens."""
    arena = isinstance(mgr, ArenaKVCacheManager)
    hits, n = [], 0
    for wave in waves:
        waiting, running = [], []
        for tokens in wave:
            n += 1
            waiting.append(_hashed(tokens, f"r{n}", block))
        for _ in range(10_000):
            if not waiting and not running:
                break
            mgr.new_step_starts()
            scheduled = {}
            for r in list(running):
                if r.num_output_tokens >= out_len:
                    mgr.free(r)
                    running.remove(r)
                    continue
                r.append_output_token_ids(5)
                assert mgr.allocate_slots(r, 1) is not None, "sized to need no preemption"
                scheduled[r] = 1
            while waiting and len(running) < max_running:
                r = waiting[0]
                blocks, hit, r.shared_prefix_boundary = mgr.get_computed_blocks(r)
                if mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
                    break
                r.status = RequestStatus.RUNNING
                r.num_computed_tokens = hit
                scheduled[r] = r.num_tokens - hit
                hits.append(hit)
                running.append(waiting.pop(0))
            for r, k in scheduled.items():
                r.num_computed_tokens += k
            if arena:
                mgr.step_processed(mgr.take_step())
        else:
            raise AssertionError("the waves did not finish")
    return hits


def _waves(seed: int = 0):
    """Three prefixes in two waves: each with two tails, then with two new tails plus one
    prompt of the first wave again (issue 45's workload, 5x smaller)."""
    import random

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    heads = [ids(600 + 37 * i) for i in range(3)]
    first = [h + ids(t) for h in heads for t in (40, 49)]
    return [first, [h + ids(t) for h in heads for t in (50, 57)] + first[:1]]


def _no_eviction_while_free_bytes_serve(monkeypatch, mgr):
    """Fails the test if an admission evicts a cached page although the free bytes (what
    compaction and relayout can gather: no fence is open while the scheduler runs here)
    held its new pages. Returns the evictions seen."""
    seen = []
    place = mgr._place

    def checked(demands, watermark, hit_bytes, keep):
        page = mgr.arena.page_bytes
        need = sum(n * page[k] for k, n in demands.items() if n < mgr._state.DEFER)
        free, before = mgr.arena.free_bytes, mgr._state.cache_stats["cache_evictions"]
        ok = place(demands, watermark, hit_bytes, keep)
        evicted = mgr._state.cache_stats["cache_evictions"] - before
        assert not (evicted and need <= free), (
            f"{evicted} cached pages evicted for {need} bytes of new pages with {free} free")
        seen.append(evicted)
        return ok

    monkeypatch.setattr(mgr, "_place", checked)
    return seen


def test_cached_pages_leave_only_for_bytes_the_free_ones_cannot_give(monkeypatch):
    """No cached page is evicted while the free bytes hold the admission's new pages: not for
    a waiting request's watermark (stock counts its free-but-cached blocks toward it and
    evicts nothing for it). (Scattered free bytes: ``test_arena_hits_at_equal_memory_at_
    least_stocks`` runs the same check through compactions.)"""
    import random

    mgr = _arena_cache(24 * PAGE, watermark=0.1)
    seen = _no_eviction_while_free_bytes_serve(monkeypatch, mgr)
    rng = random.Random(1)
    ids = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    _serve(mgr, [[ids(4 * BS), ids(4 * BS)]], out_len=1, max_running=2)  # run, cached
    st = mgr._state
    free, cached = mgr.arena.free_bytes, st.cached_free_bytes()
    k = free // PAGE // 2  # a prompt of k pages takes k full and k window pages at once
    assert cached and 2 * k * PAGE <= free < 2 * k * PAGE + mgr._watermark_bytes, (free, k)
    assert 2 * k * PAGE + mgr._watermark_bytes <= free + cached
    assert _serve(mgr, [[ids(k * BS - 1)]], out_len=1) == [0]  # admitted at once
    assert st.cache_stats["cache_evictions"] == 0 and seen and sum(seen) == 0


def test_a_prefix_leaves_whole_window_and_full_pages_together():
    """An admission that needs some of a released prompt's bytes (more than the free pages
    and the speculative window pages, which go first) cuts into the least recently released
    prompt from its end; what of it no hit can use any more goes with it: no half prefix of
    full-attention pages without their window tail stays. The newer prompt keeps its hit."""
    import random

    rng = random.Random(2)
    ids = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    mgr = _arena_cache(40 * PAGE)
    old, new = ids(10 * BS + 5), ids(10 * BS + 5)
    _serve(mgr, [[old], [new]], out_len=1)  # old released first: the colder unit
    st = mgr._state
    speculative = sum(1 for v in st.speculative if v in st.cache)
    assert speculative > 0  # the window tails a sibling would hit from
    pages = (mgr.arena.free_bytes // PAGE + speculative) // 2 + 2
    _serve(mgr, [[ids(pages * BS - 1)]], out_len=1)
    probe = {k: _hashed(toks, f"probe-{k}") for k, toks in (("old", old), ("new", new))}
    hit = {k: mgr.get_computed_blocks(r)[1] for k, r in probe.items()}
    assert hit == {"old": 0, "new": 10 * BS}, hit
    old_hashes = set(probe["old"].block_hashes) - set(probe["new"].block_hashes)
    from vllm.v1.core.kv_cache_utils import get_block_hash

    left = [v for p in st.pools for v in p.lru
            if get_block_hash(st.live[v].block_hash) in old_hashes]
    assert not left, f"pages of the evicted prompt stayed cached: {left}"


def test_arena_hits_at_equal_memory_at_least_stocks(monkeypatch):
    """Issue 45's workload (scaled down) at equal KV memory, under pressure: the arena's hit
    tokens are at least stock vLLM's at its default CPU block (128 tokens) and at 32-token
    blocks, and no admission evicted a cached page while free bytes held its pages."""
    total = 80 * PAGE  # a prefix and its running siblings at a time, the rest evicted
    waves = _waves()
    stock = {b: sum(_serve(_stock_cache(total, b), waves, block=b)) for b in (128, BS)}
    mgr = _arena_cache(total)
    seen = _no_eviction_while_free_bytes_serve(monkeypatch, mgr)
    arena = sum(_serve(mgr, waves))
    assert arena >= max(stock.values()) and arena > 0, (arena, stock)
    # Under pressure: it evicted, and compacted (free bytes scattered) without evicting.
    assert sum(seen) == mgr._state.cache_stats["cache_evictions"] > 0
    assert mgr.arena.stats["compactions"] + mgr.arena.stats["relayouts"] > 0


def test_a_decoding_gdn_state_keeps_its_page_past_the_prompt():
    """Align-mode GDN state under prefix caching (retention 0): decode crossing a 32-token
    page past the prompt keeps the running state in its page (vLLM's relocation of the block
    to the new column; stock's 640-token block never moves it there), so no state page is
    placed and none is taken from the prefix cache; the harness checks the page keeps its
    bytes (issue 45, 12 MiB: one such move evicted a cached prefix; the engine test with
    forced moves: `test_arena_prefix_caching`)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    state = MambaSpec(block_size=BS, shapes=((3, 256),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    groups = [ArenaGroup("state", "low", ("l0",), state.page_size_bytes, BS, 1),
              ArenaGroup("full", "high", ("l1",), PAGE, BS, MAX_LEN // BS)]
    total = 40 * PAGE
    layout = ArenaLayout(groups, 1024, total, total + state.page_size_bytes,
                         total + state.page_size_bytes, MAX_LEN)
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], state),
                                         KVCacheGroupSpec(["l1"], FULL)],
                        prefix_cache_retention_interval=0)
    mgr = ArenaKVCacheManager(UlaKVCacheConfig.of(cfg, layout), max_model_len=MAX_LEN,
                              scheduler_block_size=BS, hash_block_size=BS,
                              enable_caching=True, max_in_flight_tokens=MAX_LEN)
    eng = Engine(mgr)
    req = _hashed(list(range(1, 2 * BS + 6)), "r")
    got, _ = eng.step({req: req.num_tokens})
    assert got["r"] is not None
    req.status = RequestStatus.RUNNING  # (the harness counts the computed tokens)
    first = mgr.get_block_ids("r")[0]
    assert len(first) == 3 and first[-1] != 0
    for _ in range(3 * BS):  # decode to 2 * BS + 5 + 96 tokens: 3 page crossings
        req.append_output_token_ids(7)
        got, plan = eng.step({req: 1})
        assert got["r"] is not None
        ids = mgr.get_block_ids("r")[0]
        assert ids[-1] == first[-1] and set(ids[:-1]) == {0}, ids
        new = np.asarray(mgr.arena.p2v(plan.new[:, 0]), np.int64)
        assert mgr.arena.kind_index("state") not in set(mgr.arena.placement()[1][new].tolist())
    assert len(ids) == 6 and mgr._state.cache_stats["state_moves_saved"] == 3
    mgr.free(req)
    assert mgr.arena.used_bytes == mgr.arena.page_bytes[0] + mgr._state.cached_free_bytes()


COARSE = 4 * BS  # stock's GDN block in the tests below (640 tokens on the tiny Qwen3-Next)


def _gdn_specs(block):
    from vllm.v1.kv_cache_interface import MambaSpec

    state = MambaSpec(block_size=block, shapes=((3, 256),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    full = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return state, full


def _gdn_arena():
    """The arena over an align-mode GDN state group and a full-attention group (32-token
    pages), prefix caching at vLLM's retention 0, the state checkpoint at stock's block."""
    state, full = _gdn_specs(BS)
    groups = [ArenaGroup("state", "low", ("l0",), state.page_size_bytes, BS, 1),
              ArenaGroup("full", "high", ("l1",), PAGE, BS, MAX_LEN // BS)]
    total = 200 * PAGE
    layout = ArenaLayout(groups, 1024, total, total + state.page_size_bytes,
                         total + state.page_size_bytes, MAX_LEN)
    layout.state_checkpoint_tokens = COARSE
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], state),
                                         KVCacheGroupSpec(["l1"], full)],
                        prefix_cache_retention_interval=0)
    return ArenaKVCacheManager(UlaKVCacheConfig.of(cfg, layout), max_model_len=MAX_LEN,
                               scheduler_block_size=BS, hash_block_size=BS,
                               enable_caching=True, max_in_flight_tokens=MAX_LEN)


def _gdn_stock():
    """vLLM's own manager for the same groups at stock's block (hash block = block)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    state, full = _gdn_specs(COARSE)
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], state),
                                         KVCacheGroupSpec(["l1"], full)],
                        prefix_cache_retention_interval=0)
    return KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=COARSE,
                          hash_block_size=COARSE, enable_caching=True,
                          max_in_flight_tokens=MAX_LEN)


def _sibling_admissions(mgr, block):
    """A prompt's prefill in two chunks (stock's split: its coarse block, then the rest),
    then three siblings sharing its first COARSE + 20 tokens queued from its second chunk,
    first come first served, the running ones decoding. Returns (step, sibling, hit tokens)
    per admission attempt, None where the manager deferred it."""
    import random

    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, 1000) for _ in range(n)]  # noqa: E731
    head = ids(COARSE + 20)
    a = _hashed(head + ids(20), "a", block)
    waiting = [_hashed(head + ids(25 + 5 * i), f"s{i}", block) for i in range(3)]
    chunks, running, log = [COARSE, a.num_tokens - COARSE], [], []
    for step in range(1, 8):
        mgr.new_step_starts()
        scheduled = {}
        for r in running:
            r.append_output_token_ids(5)
            assert mgr.allocate_slots(r, 1) is not None
            scheduled[r] = 1
        if chunks:
            n = chunks.pop(0)
            assert mgr.allocate_slots(a, n) is not None
            a.status = RequestStatus.RUNNING
            scheduled[a] = n
            if not chunks:
                running.append(a)
        while step > 1 and waiting:
            r = waiting[0]
            blocks, hit, r.shared_prefix_boundary = mgr.get_computed_blocks(r)
            if mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
                log.append((step, r.request_id, None))
                break
            log.append((step, r.request_id, hit))
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = hit
            scheduled[r] = r.num_tokens - hit
            running.append(waiting.pop(0))
        for r, k in scheduled.items():
            r.num_computed_tokens += k
        if isinstance(mgr, ArenaKVCacheManager):
            mgr.step_processed(mgr.take_step())
    return log


def test_a_gdn_prefix_state_is_hit_once_a_step_as_stock(monkeypatch):
    """Siblings hitting one GDN prefix state are admitted one a step, in the steps stock's
    manager admits them (issue 45, 12/16 MiB: the arena admitted them together, so a prompt
    prefilled in another batch than stock's and bf16 GDN gave other tokens): vLLM's align
    mode defers a second hit of a state in the step its prompt's last chunk runs and in the
    step another request hitting it is admitted (`_cache_partial_tail_block` at the prompt's
    last hash-block boundary, stock's 640-token block); the arena, at 32-token pages, keeps
    that state at stock's block and applies the rule there too
    (`patches/mamba_same_step_hit`)."""
    from ulacache_vllm.patches import mamba_same_step_hit

    stock = _sibling_admissions(_gdn_stock(), COARSE)
    assert stock == [(2, "s0", None), (3, "s0", COARSE), (3, "s1", None), (4, "s1", COARSE),
                     (4, "s2", None), (5, "s2", COARSE)], stock
    assert _sibling_admissions(_gdn_arena(), BS) == stock
    # Without the rule at stock's block the arena admits all three in the first step.
    monkeypatch.setattr(mamba_same_step_hit, "install", lambda *a, **k: False)
    assert _sibling_admissions(_gdn_arena(), BS) == [(2, f"s{i}", COARSE) for i in range(3)]


def test_new_pages_are_zeroed_only_for_the_kinds_the_layout_zeroes():
    """vLLM's CPU runner zeroes new full-attention blocks only; a sliding kind the layout does
    not zero (`ArenaGroup.zeroed`, false for sliding windows from `plan_arena`: DeepSeek-V4's
    window and compressor states) sends no new page to be zeroed, the full kind all of its."""
    import dataclasses

    layout = _layout(64)
    layout.groups[0] = dataclasses.replace(layout.groups[0], zeroed=False)
    cfg = KVCacheConfig(num_blocks=layout.num_granules, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], SWA),
                                         KVCacheGroupSpec(["l1"], FULL)])
    mgr = ArenaKVCacheManager(UlaKVCacheConfig.of(cfg, layout), max_model_len=MAX_LEN,
                              scheduler_block_size=BS, hash_block_size=BS,
                              enable_caching=False, max_in_flight_tokens=BS)
    req = _request("a", 5 * BS)
    blocks = mgr.allocate_slots(req, req.num_tokens)
    assert blocks is not None
    plan = mgr.take_step()
    v2p, kind = mgr.arena.placement()
    full = [v for v in blocks.get_block_ids()[1] if v]
    sliding = [v for v in blocks.get_block_ids()[0] if v]
    assert full and sliding
    assert sorted(plan.new[:, 0].tolist()) == sorted(v2p[full].tolist())
    assert set(plan.new[:, 1].tolist()) == {mgr.arena.page_bytes[2]}
