"""TP shard mode without an engine: the canonical top-k and its sharded merge, a rank's share
of the indexer scores, and two gloo processes running sharded stores and exchanges."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from test_indexer_scores import assert_shards_merge_to_the_whole

from ulacache_vllm.engine.dsa.indexer_scores import indexer_logits, on_fp8_grid
from ulacache_vllm.engine.dsa.topk import (
    canonical_topk,
    local_candidates,
    merge_candidates,
    pack_candidates,
    unpack_candidates,
)

import _tp_workers


def _reference(scores: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """Brute force: sort by (score desc, position asc), keep k, list positions ascending."""
    n, m = scores.shape
    out = torch.full((n, k), -1, dtype=torch.int32)
    for i in range(n):
        c = sorted((-scores[i, j].item(), positions[j].item()) for j in range(m)
                   if scores[i, j] > float("-inf"))
        sel = sorted(p for _, p in c[:k])
        out[i, :len(sel)] = torch.tensor(sel, dtype=torch.int32)
    return out


def _shard(scores, positions, P, k):
    cs, cp = [], []
    for r in range(P):
        v, p = local_candidates(scores[:, r::P], positions[r::P], k)
        cs.append(v)
        cp.append(p)
    # Through the float32 all-gather payload, as the engine sends them.
    packed = torch.stack([pack_candidates(v, p) for v, p in zip(cs, cp)])
    s, p = unpack_candidates(packed)
    return merge_candidates(s, p, k)


@pytest.mark.parametrize("seed", range(6))
def test_canonical_topk_and_the_sharded_merge_equal_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    for it in range(30):
        n = int(torch.randint(1, 5, (1,), generator=g))
        m = int(torch.randint(0, 50, (1,), generator=g))
        k = int(torch.randint(1, 16, (1,), generator=g))
        if it % 3 == 2:  # distinct scores (no tie at the k-th place: top-k's own set)
            scores = torch.randn(n, m, generator=g)
            if it % 2:
                scores[torch.rand(n, m, generator=g) < 0.1] = float("-inf")
        else:
            # Few distinct values: ties everywhere, also at the k-th place; some keys masked.
            scores = torch.randint(-2, 3, (n, m), generator=g).float()
            scores[torch.rand(n, m, generator=g) < 0.25] = float("-inf")
        base = 0 if seed % 2 else (1 << 24) + 3  # positions past float32's exact integers
        positions = torch.arange(m) + base
        ref = _reference(scores, positions, k)
        assert torch.equal(canonical_topk(scores, positions, k), ref)
        for P in (2, 3, 4, 8):
            assert torch.equal(_shard(scores, positions, P, k), ref), (P, scores, k)


def test_fewer_keys_than_k_and_all_masked():
    s = torch.tensor([[1.0, float("-inf"), 1.0], [float("-inf")] * 3])
    out = canonical_topk(s, torch.arange(3), 5)
    assert out.tolist() == [[0, 2, -1, -1, -1], [-1] * 5]
    assert torch.equal(_shard(s, torch.arange(3), 2, 5), out)


def test_torch_topk_alone_would_not_be_canonical():
    """Why the canonical order exists: ties at the k-th place are common in DSA."""
    s = torch.zeros(1, 200)
    s[0, 150:] = 1.0
    assert canonical_topk(s, torch.arange(200), 60).tolist()[0] == list(range(10)) + list(range(150, 200))


@pytest.mark.parametrize("P,H,L", [(2, 4, 300), (4, 4, 300), (8, 4, 300), (2, 8, 3),
                                   (4, 8, 33), (8, 64, 20), (3, 7, 150)])
def test_a_rank_s_share_of_the_indexer_scores_is_bitwise_the_whole_scoring(P, H, L):
    """Short contexts and few heads included: shards of 1 to 100 keys (a head sum as a bmm
    took another kernel there, and a single key another product, on some hosts)."""
    g = torch.Generator().manual_seed(P * 1000 + L)
    n, D = min(24, L), 128
    q = torch.randn(n, H, D, generator=g)
    w = torch.randn(n, H, generator=g)
    keys = torch.randn(L, D, generator=g)
    qpos = torch.arange(L - n, L)
    full = indexer_logits(q, w, keys, qpos, torch.arange(L), exact=on_fp8_grid(keys))
    for r in range(P):
        kp = torch.arange(r, L, P)
        mine = indexer_logits(q, w, keys[r::P], qpos, kp, exact=on_fp8_grid(keys))
        assert torch.isfinite(mine).any()
        assert torch.equal(mine.view(torch.int32), full[:, kp].view(torch.int32))  # bits
    # ... and the merged selection is the whole indexer's, at the engine's k.
    assert_shards_merge_to_the_whole(q, w, keys, qpos, 64, P)


# The two-rank bodies of the tests below, run by one pair of spawned gloo processes (a spawned
# rank imports torch and the store's modules once for all of them, not once per test).
WORKERS = (_tp_workers.skewed_worker, _tp_workers.diverging_worker, _tp_workers.replica_worker,
           _tp_workers.rewrite_worker, _tp_workers.fill_worker)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """``ranks(worker) -> [rank 0's result, rank 1's]``: every body of WORKERS run in turn
    (``_tp_workers.run_in_turn``) by the same two processes, once, at the first test that asks."""
    out = tmp_path_factory.mktemp("tp_shard")
    ran: list[BaseException | None] = []

    def get(fn):
        if not ran:
            try:
                mp.start_processes(_tp_workers.run_in_turn, args=(2, str(out), WORKERS),
                                   nprocs=2, join=True, start_method="spawn")
                ran.append(None)
            except Exception as e:  # noqa: BLE001 - raised by every test that reads a result
                ran.append(e)
        if ran[0] is not None:
            raise ran[0]
        return [json.load(open(os.path.join(out, fn.__name__, f"rank{r}.json")))
                for r in range(2)]
    return get


def test_two_ranks_one_overflowing_its_pool_read_exactly_and_stay_in_lockstep(ranks):
    r0, r1 = ranks(_tp_workers.skewed_worker)
    for r in (r0, r1):
        assert r["errors"] == 0, r
        t = r["totals"]
        assert t["remote_rows_fetched"] > 0 and t["remote_hits"] > 0, t
        assert r["end"]["device_used"] == 0 and r["end"]["host_used"] == 0, r
        assert r["end"]["remote_used"] == 0, r  # freed entries leave the buffers
        assert r["identity"]
    # Rank 0 holds most tokens: it overflowed (demotions, chunked settles), rank 1 did not.
    assert r0["totals"]["demotions"] > 0 and r0["totals"]["fallback_chunks"] > 0, r0
    assert r1["totals"]["demotions"] == 0 and r1["totals"]["fallback_chunks"] == 0, r1
    assert r0["mid"] != r1["mid"]  # shards, not replicas


def test_a_diverging_rank_raises_instead_of_hanging(ranks):
    r0, r1 = ranks(_tp_workers.diverging_worker)
    for r in (r0, r1):
        assert "ranks diverged" in r["error"], r


def test_replicated_while_it_fits_then_shards_then_replicated_again(ranks):
    r0, r1 = ranks(_tp_workers.replica_worker)
    for r in (r0, r1):
        assert r["limit"] == 64, r
        assert r["replica_exact"] and r["replica_gathers"] == 0, r  # local reads, no exchange
        assert r["replica_usage"] == 40 * 2  # every token on every rank (2 layer groups)
        assert r["replicas_after"] is False and r["shard_errors"] == 0, r
        assert r["totals"]["replica_exits"] == 1 and r["totals"]["remote_rows_fetched"] > 0, r
        assert r["replicas_again"] is True
        assert r["end_usage"]["device_used"] == 0 and r["end_usage"]["host_used"] == 0, r
        assert r["again_exact"], r
    assert r0["shard_usage"] != r1["shard_usage"] or r0["shard_usage"] < 2 * 136  # shards


def test_rows_rewritten_in_place_are_never_served_stale_from_a_remote_buffer(ranks):
    r0, r1 = ranks(_tp_workers.rewrite_worker)
    for r in (r0, r1):
        assert r["replicas"] is False, r  # sharded: the other rank's rows come over the wire
        assert r["buffered"] > 0, r  # the rows were in the buffer before their rewrite
        assert r["errors"] == 0, r


def test_a_buffer_reads_seldom_hit_stops_filling_and_fills_again_on_reuse(ranks):
    """--ula-remote-buffer-min-hit-rate (default 0.1): random picks over 1024 rows seldom
    hit a 64-row buffer, so its settles stop (probes aside); repeated picks bring the fills
    back and hit. Reads stay exact, and the replicated directory stays the same on both
    ranks (the decisions use only figures every rank shares)."""
    r0, r1 = ranks(_tp_workers.fill_worker)
    for r in (r0, r1):
        assert r["errors"] == 0 and r["replicas"] is False, r
        low, t = r["low"], r["totals"]
        # Random picks: most settles skipped (2 groups x 24 steps), a few probes ran.
        assert low["remote_fill_skips"] >= 24, low
        # Repeated picks: fills came back (no more skips after the reuse was seen) and hit.
        assert t["remote_fill_skips"] - low["remote_fill_skips"] <= 2 * 16, (low, t)
        assert t["remote_hits"] - low["remote_hits"] > 8 * 16, (low, t)
        assert min(r["rates"]) > 0.5, r["rates"]
    assert r0["tables"] == r1["tables"]
    assert r0["totals"]["remote_fill_skips"] == r1["totals"]["remote_fill_skips"]
