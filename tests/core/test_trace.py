"""Trace generator, file formats and replay: what the PB-LRU benchmark relies on."""

import json

import numpy as np
import pytest
import torch

from ulacache_vllm.core import TieredMapping
from lab.policies import factory
from lab.trace import generate_dsa_trace, load_trace, replay, save_trace


@pytest.fixture(scope="module")
def trace():
    return generate_dsa_trace(num_steps=40, batch=4, topk=64, prompt_len=(200, 400),
                              decode_len=(8, 20), overlap=(0.7, 0.9), seed=7)


def _requests_sets(tr):
    """Per request, its selection sets in step order."""
    out = {}
    for st in tr.steps:
        for r in st.select_req.unique().tolist():
            out.setdefault(r, []).append(set(st.select_addr[st.select_req == r].tolist()))
    return out


def test_generator_controls_overlap_and_shares_one_pool(trace):
    per_req = _requests_sets(trace)
    assert len(per_req) > 4, "requests should finish and be replaced"
    ratios = [len(a & b) / len(b) for sets in per_req.values() for a, b in zip(sets, sets[1:])]
    # New picks avoid the previous set: the measured overlap is the drawn one, up to rounding.
    assert ratios and 0.7 - 1 / 64 <= min(ratios) and max(ratios) <= 0.9 + 1 / 64
    assert max(ratios) - min(ratios) > 0.05, "overlap is drawn per request"
    for st in trace.steps:  # one top-k per decoding request, no address selected twice by it
        for r in st.select_req.unique().tolist():
            sel = st.select_addr[st.select_req == r]
            assert sel.numel() == 64 and sel.unique().numel() == 64
    assert 0 < trace.peak_demand <= trace.working_set


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_save_load_roundtrip_replays_identically(trace, tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    save_trace(trace, str(path))
    back = load_trace(str(path))
    assert back.num_logical == trace.num_logical
    assert (back.working_set, back.peak_demand) == (trace.working_set, trace.peak_demand)
    assert len(back.steps) == len(trace.steps)
    for a, b in zip(trace.steps, back.steps):
        assert a.step == b.step and a.group == b.group
        for f in ("free_addr", "append_addr", "select_addr", "select_req"):
            assert torch.equal(getattr(a, f).sort().values, getattr(b, f).sort().values), f
    stats = []
    for tr in (trace, back):
        pool = trace.peak_demand * 3 // 2
        m = TieredMapping(tr.num_logical, pool, tr.num_logical, lru="pblru")
        replay(tr, {0: m})
        assert m.stats.demotions > 0 and m.stats.promotions > 0, "pool too large to exercise eviction"
        stats.append((m.stats.hits, m.stats.lookups, m.stats.demotions))
    assert stats[0] == stats[1]


def test_loader_rejects_foreign_files(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, foo=np.arange(3))
    with pytest.raises(ValueError, match="missing arrays"):
        load_trace(str(bad))
    j = tmp_path / "x.jsonl"
    j.write_text(json.dumps({"step": 0, "kind": "evict", "addr": [1]}) + "\n")
    with pytest.raises(ValueError, match="kind"):
        load_trace(str(j))
    j.write_text(json.dumps({"num_logical": 4}) + "\n"
                 + json.dumps({"step": 0, "kind": "append", "addr": [9]}) + "\n")
    with pytest.raises(ValueError, match="outside num_logical"):
        load_trace(str(j))


@pytest.mark.parametrize("ov", [(0.0, 0.0), (0.3, 0.3), (1.0, 1.0)])
def test_overlap_extremes_are_exact_and_topk_is_kept(ov):
    k = 32
    tr = generate_dsa_trace(num_steps=25, batch=3, topk=k, prompt_len=(300, 400),
                            decode_len=(10, 15), overlap=ov, seed=3)
    ratios = [len(a & b) / k for sets in _requests_sets(tr).values() for a, b in zip(sets, sets[1:])]
    want = min(round(ov[0] * k), k - 1) / k  # the newest token is always a new pick
    assert ratios and all(abs(r - want) < 1e-9 for r in ratios), (want, sorted(set(ratios)))
    for st in tr.steps:
        for r in st.select_req.unique().tolist():
            assert int((st.select_req == r).sum()) == k


@pytest.mark.parametrize("kw", [dict(prompt_len=(0, 0)), dict(overlap=(0.9, 0.5)),
                                dict(overlap=(0.5, 1.5)), dict(batch=0), dict(topk=0),
                                dict(decode_len=(5, 2)), dict(recency_mix=2.0),
                                dict(overlap=0.5), dict(prompt_len=10), dict(batch=1.5),
                                dict(topk=2.5), dict(prompt_len=(10.0, 20.0)), dict(batch=True)])
def test_generator_rejects_bad_parameters(kw):
    with pytest.raises(ValueError, match="generate_dsa_trace"):
        generate_dsa_trace(num_steps=3, **kw)


def _npz(path, **over):
    cols = dict(step=np.array([0, 0]), group=np.array([0, 0]), kind=np.array([1, 2]),
                req=np.array([0, 0]), addr=np.array([0, 1]))
    cols.update(over)
    with open(path, "wb") as f:
        np.savez(f, **cols)


@pytest.mark.parametrize("over, msg", [
    (dict(addr=np.array([0, -5])), "'addr' value -5"),
    (dict(addr=np.array([0.0, 1.7])), "must hold integers"),
    (dict(addr=np.array([0, 1, 2])), "one row per event"),
    (dict(kind=np.array([1, 7])), "'kind' value 7"),
    (dict(group=np.array([0, -1])), "'group' value -1"),
    (dict(group=np.array([0, 1 << 20])), "'group' value"),
    (dict(step=np.array([-1, 0])), "'step' value -1"),
])
def test_loader_rejects_malformed_npz(tmp_path, over, msg):
    p = tmp_path / "t.npz"
    _npz(p, **over)
    with pytest.raises(ValueError, match=msg):
        load_trace(str(p))


@pytest.mark.parametrize("line, msg", [
    ({"step": 0, "kind": "append", "adr": [0]}, "neither a header"),
    ({"step": 0, "kind": "append", "addr": 5}, "1-D list"),
    ({"step": 0, "kind": "append", "addr": [0.5]}, "must hold integers"),
    ({"step": 1.5, "kind": "append", "addr": [0]}, "step must be an integer"),
    ({"step": 0, "kind": "select", "addr": [0, 1], "req": [3]}, "'req' has 1 entries"),
    ({"step": 0, "kind": "append", "addr": [-1]}, "'addr' value -1"),
    ([1, 2], "must be a JSON object"),
    ({"step": 2**63, "kind": "free", "addr": [1]}, "line 2: OverflowError"),
    ({"step": 0, "group": 2**64, "kind": "free", "addr": [1]}, "line 2: OverflowError"),
    ({"step": 0, "kind": ["free"], "addr": [1]}, "line 2: TypeError"),
    ({"step": 0, "kind": "free", "addr": [1], "req": 2**64}, "line 2: OverflowError"),
    ({"step": 0, "kind": "free", "addr": [1, [2]]}, "line 2: ValueError"),
])
def test_loader_rejects_malformed_jsonl(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"num_logical": 8}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=msg) as e:
        load_trace(str(p))
    assert str(p) in str(e.value)


@pytest.mark.parametrize("damage", ["empty", "truncated", "corrupt_member", "object_array"])
def test_loader_names_unreadable_npz_files(tmp_path, trace, damage):
    """Empty, truncated or corrupted archives and pickled object arrays are a ValueError
    naming the file (not EOFError / BadZipFile / zlib.error)."""
    good, p = tmp_path / "good.npz", tmp_path / "bad.npz"
    save_trace(trace, str(good))
    raw = good.read_bytes()
    if damage == "object_array":
        _npz(p, addr=np.array([0, [1]], dtype=object))
    else:
        bad = {"empty": b"", "truncated": raw[: len(raw) // 2],
               "corrupt_member": raw[:60] + b"\0" * 20 + raw[80:]}[damage]
        p.write_bytes(bad)
    with pytest.raises(ValueError, match="unreadable npz") as e:
        load_trace(str(p))
    assert str(p) in str(e.value)


def test_generator_writes_the_whole_prompt_of_a_request_without_decode_steps():
    tr = generate_dsa_trace(num_steps=6, batch=1, topk=4, prompt_len=(10, 10), decode_len=(0, 0),
                            prefill_chunk=4)
    appended = []
    for s in tr.steps:
        if s.free_addr.numel():
            assert sorted(s.free_addr.tolist()) == sorted(appended)  # freed once fully written
            break
        appended += s.append_addr.tolist()
    assert len(appended) == 10


def test_loader_sniffs_and_save_keeps_the_name(tmp_path, trace):
    p = tmp_path / "t.bin"
    save_trace(trace, str(p))
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.bin"]  # numpy adds no .npz
    assert len(load_trace(str(p)).steps) == len(trace.steps)
    up = tmp_path / "t.JSONL"
    save_trace(trace, str(up))
    assert up.read_text().startswith("{")
    assert len(load_trace(str(up)).steps) == len(trace.steps)
    (tmp_path / "text.npz").write_text("{}\n")
    with pytest.raises(ValueError, match="not an npz archive"):
        load_trace(str(tmp_path / "text.npz"))


def test_engine_style_jsonl_with_repeated_headers(tmp_path):
    p = tmp_path / "e.jsonl"
    lines = [{"num_logical": 16}, {"step": 0, "group": 1, "kind": "append", "req": 0, "addr": [0, 1]},
             {"num_logical": 32}, {"step": 1, "group": 1, "kind": "select", "req": [0, 0], "addr": [1, 20]}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tr = load_trace(str(p))
    assert tr.num_logical == 32 and [(s.step, s.group) for s in tr.steps] == [(0, 1), (1, 1)]


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_roundtrip_of_a_hand_made_trace_without_requests(tmp_path, suffix):
    """A trace built by hand (no per-address request ids) saves and loads in both formats."""
    from lab.trace import Trace, TraceStep
    tr = Trace([TraceStep(0, select_addr=torch.tensor([1, 2]), append_addr=torch.tensor([1, 2]))], 4)
    path = tmp_path / f"t{suffix}"
    save_trace(tr, str(path))
    back = load_trace(str(path))
    assert back.num_logical == 4 and len(back.steps) == 1
    st = back.steps[0]
    assert st.select_addr.tolist() == [1, 2] and st.append_addr.tolist() == [1, 2]
    assert st.select_req.tolist() in ([], [-1, -1])


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_loaded_demand_counts_distinct_entries_per_group(tmp_path):
    # Eight addresses, each selected by four requests: one round needs 8 device slots, not 32.
    rows = [{"step": 0, "kind": "append", "req": 0, "addr": list(range(8))},
            {"step": 1, "kind": "select", "req": [r for r in range(4) for _ in range(8)],
             "addr": list(range(8)) * 4},
            # group 1 has its own pool: its 3 live selected entries are not added to group 0's
            {"step": 1, "group": 1, "kind": "append", "req": 0, "addr": [8, 9, 10]},
            {"step": 2, "group": 1, "kind": "select", "req": 0, "addr": [8, 9, 10]}]
    t = load_trace(_write_jsonl(tmp_path / "dups.jsonl", rows))
    assert t.num_logical == 11 and t.peak_demand == 8 and t.working_set == 8  # not 11


def test_loader_takes_sparse_huge_addresses(tmp_path):
    rows = [{"step": 0, "kind": "append", "req": 0, "addr": [0, 2**40]},
            {"step": 1, "kind": "select", "req": 0, "addr": [2**40]}]
    t = load_trace(_write_jsonl(tmp_path / "sparse.jsonl", rows))
    assert t.num_logical == 2**40 + 1 and t.working_set == 1 and t.peak_demand == 2


def test_generator_seed_types_and_json_meta():
    kw = dict(num_steps=2, topk=2, prompt_len=(2, 4), decode_len=(1, 2))
    a = generate_dsa_trace(batch=np.int64(1), seed=np.int64(3), **kw)
    b = generate_dsa_trace(batch=1, seed=3, **kw)
    assert all(torch.equal(x.select_addr, y.select_addr) for x, y in zip(a.steps, b.steps))
    assert json.loads(json.dumps(a.meta)) == {"batch": 1, "topk": 2, "overlap": [0.6, 0.95], "seed": 3}
    for bad in (3.0, None, "3", -1):
        with pytest.raises(ValueError, match="seed"):
            generate_dsa_trace(batch=1, seed=bad, **kw)


def test_replay_splits_a_round_larger_than_the_pool_like_the_engine(tmp_path):
    """Two requests select 6 entries each in one round of an 8-slot pool: the replay attends
    request by request in slices of half the pool (a new round before each), as the engine's
    chunked attention does; every policy sees the same chunks, and the queue PB-LRU the same
    hits as the exact LRUs (the round-label and bitmap PB-LRUs order a round by slot)."""
    rows = [{"step": 0, "kind": "append", "req": 0, "addr": list(range(6))},
            {"step": 1, "kind": "append", "req": 1, "addr": list(range(6, 12))},
            {"step": 2, "kind": "select", "req": [0] * 6 + [1] * 6, "addr": list(range(12))}]
    t = load_trace(_write_jsonl(tmp_path / "big.jsonl", rows))
    assert t.peak_append == 6 and t.peak_demand == 12
    stats = set()
    for lru in ("pblru", "pblru_queue", "pblru_bitmap", "exact_ts", "exact_list"):
        m = TieredMapping(t.num_logical, 8, 16, lru=factory(lru))
        assert replay(t, {0: m}) == 4  # [0:4] [4:6] of request 0, [6:10] [10:12] of request 1
        assert m.stats.lookups == 12 and m.stats.promotions > 0 and m.device_used <= 8
        if lru not in ("pblru", "pblru_bitmap"):
            stats.add((m.stats.hits, m.stats.promotions, m.stats.demotions))
        assert replay(t, {0: TieredMapping(t.num_logical, 12, 16, lru=factory(lru))}) == 0  # it fits
    assert len(stats) == 1, stats
