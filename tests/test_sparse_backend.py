"""Correctness of the CPU sparse-MLA backend (DSA models on vLLM's CPU build).

Unit part (fast, no engine): the sparse attention math against a dense float64 reference over
exactly the selected positions; request-local positions -> slots -> rows of a block-strided
cache against hand-computed numbers; the impl's own `do_kv_cache_update` + `forward_mqa`
plumbing; the indexer's fp8 key cache round trip and its top-k selection against brute force.

End-to-end part (vLLM engines in subprocesses, one per model, `tests/scripts/sparse_e2e.py`):
a. a DSA model whose index_topk (512) covers every context gives the dense-MLA twin's
   prompt / next-token logprobs (same weights, indexer dropped);
b. with index_topk 16 < context the selections are really sparse (checked on every indexer
   call), logprobs leave the dense ones once the prefix exceeds 16 and are bit-identical to the
   512 model's while it does not; generation is deterministic across runs;
c. batched and single-request greedy generation give identical tokens.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ulacache_vllm.engine.dsa import cpu_indexer, sparse_math
from ulacache_vllm.engine.dsa.cpu_sparse_mla import (
    CpuSparseMLAImpl,
    CpuSparseMLAMetadata,
    flat_rows,
)
from ulacache_vllm.engine.dsa.kv_translation import positions_to_slots, slots_to_rows

REPO = Path(__file__).resolve().parents[1]
E2E_SCRIPT = REPO / "tests" / "scripts" / "sparse_e2e.py"
MARK = "@@SPARSE_E2E@@"

D_LATENT, D_ROPE = 512, 64
D_QK = D_LATENT + D_ROPE


# --------------------------------------------------------------------------------------------
# helpers


def _strided_cache(num_blocks, block_size, stride_rows, d, dtype=torch.float32, seed=0):
    """[num_blocks, block_size, d] view whose blocks are `stride_rows` rows apart (as vLLM's
    cache views may be); the gap rows hold NaN so reading them poisons any result."""
    g = torch.Generator().manual_seed(seed)
    base = torch.full((num_blocks, stride_rows, d), float("nan"), dtype=dtype)
    cache = base[:, :block_size]
    cache.copy_(torch.randn(num_blocks, block_size, d, generator=g, dtype=torch.float32))
    return cache


def _dense_reference(q, kv_of_token, scale, d_v):
    """q [H, D], kv [k, D] (selected rows, any order) -> out [H, d_v] float64."""
    q64, kv = q.double(), kv_of_token.double()
    p = torch.softmax(q64 @ kv.T * scale, dim=-1)
    return p @ kv[:, :d_v], torch.logsumexp(q64 @ kv.T * scale, dim=-1)


def _random_selections(prefix_lens, k, rng, empty_tokens=(), pad_anywhere=True):
    """[T, k] int32 request-local positions: distinct, causal, -1 padded."""
    out = torch.full((len(prefix_lens), k), -1, dtype=torch.int32)
    for t, L in enumerate(prefix_lens):
        if t in empty_tokens:
            continue
        n = rng.randint(1, min(k, L))
        sel = rng.sample(range(L), n)
        slots = rng.sample(range(k), n) if pad_anywhere else list(range(n))
        for s, p in zip(slots, sel):
            out[t, s] = p
    return out


# --------------------------------------------------------------------------------------------
# unit: kv translation


def test_positions_to_slots_and_rows_by_hand():
    B, stride = 4, 6
    block_table = torch.tensor([[5, 2, 7], [1, 0, 3]], dtype=torch.int32)
    positions = torch.tensor([[0, 5, -1], [9, 3, 4], [-1, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1], dtype=torch.int32)
    slots = positions_to_slots(positions, req, block_table, B)
    # req 0: pos 0 -> block 5 off 0 = 20; pos 5 -> block 2 off 1 = 9
    # req 1: pos 9 -> block 3 off 1 = 13; pos 3 -> block 1 off 3 = 7; pos 4 -> block 0 off 0 = 0
    assert slots.tolist() == [[20, 9, -1], [13, 7, 0], [-1, -1, -1]]
    rows = slots_to_rows(slots, B, stride)
    # rows = block * 6 + offset
    assert rows.tolist() == [[30, 13, -1], [19, 9, 0], [-1, -1, -1]]
    assert slots_to_rows(slots, B, B).tolist() == slots.tolist()  # unstrided: identity

    cache = _strided_cache(8, B, stride, 3)
    flat, stride_rows = flat_rows(cache)
    assert stride_rows == stride
    assert flat.shape == (7 * stride + B, 3)
    for blk in range(8):
        for off in range(B):
            assert torch.equal(flat[blk * stride + off], cache[blk, off])
    # the row the hand computation names is the cache entry of that request-local position
    assert torch.equal(flat[30], cache[5, 0]) and torch.equal(flat[19], cache[3, 1])
    # a contiguous cache is its own flat view
    c2 = torch.randn(3, B, 5)
    f2, s2 = flat_rows(c2)
    assert s2 == B and torch.equal(f2, c2.reshape(-1, 5))


# --------------------------------------------------------------------------------------------
# unit: sparse attention math


def _setup_requests(seed=0, B=16, stride=20, num_blocks=12):
    rng = random.Random(seed)
    seq_lens = [37, 5, 61]  # three requests
    blocks_needed = [(L + B - 1) // B for L in seq_lens]
    perm = rng.sample(range(num_blocks), sum(blocks_needed))
    maxb = max(blocks_needed)
    bt = torch.zeros(len(seq_lens), maxb, dtype=torch.int32)
    i = 0
    for r, nb in enumerate(blocks_needed):
        bt[r, :nb] = torch.tensor(perm[i:i + nb], dtype=torch.int32)
        i += nb
    cache = _strided_cache(num_blocks, B, stride, D_QK, seed=seed)
    # tokens: a few per request (prefill-like tail and decode-like last)
    toks = [(0, 30), (0, 36), (1, 0), (1, 4), (2, 10), (2, 59), (2, 60), (0, 20)]
    return rng, seq_lens, bt, cache, toks, B


@pytest.mark.parametrize("chunk", [256, 3])
def test_sparse_mla_attention_equals_dense_over_selected(monkeypatch, chunk):
    monkeypatch.setattr(sparse_math, "TOKEN_CHUNK", chunk)
    rng, seq_lens, bt, cache, toks, B = _setup_requests()
    K, H, d_v, scale = 16, 4, D_LATENT, 0.1
    empty = {3}
    sel = _random_selections([p + 1 for _, p in toks], K, rng, empty_tokens=empty)
    assert any(len(set(r)) < K for r in sel.tolist())  # some -1 padding present
    req = torch.tensor([r for r, _ in toks], dtype=torch.int32)
    q = torch.randn(len(toks), H, D_QK, generator=torch.Generator().manual_seed(1))

    flat, stride_rows = flat_rows(cache)
    rows = slots_to_rows(positions_to_slots(sel, req, bt, B), B, stride_rows)
    out, lse = sparse_math.sparse_mla_attention(q, flat, rows, scale, d_v)
    assert out.shape == (len(toks), H, d_v) and out.dtype == torch.float32
    assert torch.isfinite(out).all()

    for t, (r, _) in enumerate(toks):
        chosen = [p for p in sel[t].tolist() if p >= 0]
        if not chosen:
            assert torch.equal(out[t], torch.zeros(H, d_v))
            assert torch.isinf(lse[t]).all() and (lse[t] < 0).all()
            continue
        # gather straight from the 3-D cache: block_table[req, p // B], offset p % B
        kv = torch.stack([cache[int(bt[r, p // B]), p % B] for p in chosen])
        ref, ref_lse = _dense_reference(q[t], kv, scale, d_v)
        torch.testing.assert_close(out[t].double(), ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(lse[t].double(), ref_lse, rtol=0, atol=1e-5)

    # per-token results do not depend on the other tokens of the batch
    sub = [6, 0, 4]
    out_sub, _ = sparse_math.sparse_mla_attention(q[sub], flat, rows[sub], scale, d_v)
    torch.testing.assert_close(out_sub, out[sub], rtol=0, atol=1e-6)

    # Staged host rows: move a random half of the selected rows to a "host pool" (their device
    # rows zeroed); reading them from there gives bit-identical results.
    g = torch.Generator().manual_seed(2)
    moved = torch.rand(flat.shape[0], generator=g) < 0.5  # per physical row: one tier each
    host_slot = torch.randperm(flat.shape[0], generator=g)  # where a moved row lands
    on_host = (rows >= 0) & moved[rows.clamp(min=0)]
    assert on_host.any() and ((rows >= 0) & ~on_host).any()
    host_kv = torch.randn(flat.shape[0], flat.shape[1], generator=g)  # junk where unused
    host_rows = torch.where(on_host, host_slot[rows.clamp(min=0)], -1)
    host_kv[host_rows[on_host]] = flat[rows[on_host]]
    dev_flat = flat.clone()
    dev_flat[rows[on_host]] = float("nan")  # never read: those rows live on the host now
    dev_rows = torch.where(on_host, -1, rows)
    out_h, lse_h = sparse_math.sparse_mla_attention(q, dev_flat, dev_rows, scale, d_v,
                                                    staged=[(host_rows, host_kv)])
    assert torch.equal(out_h, out) and torch.equal(lse_h, lse)


def _impl(num_heads=4, kv_lora_rank=D_LATENT):
    return CpuSparseMLAImpl(
        num_heads=num_heads, head_size=D_QK, scale=0.125, num_kv_heads=1, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
        kv_sharing_target_layer_name=None, topk_indices_buffer=None, indexer=None,
        kv_lora_rank=kv_lora_rank,
    )


def test_impl_kv_update_and_forward_mqa():
    """The impl writes rows where the slot mapping says (skipping -1) into a block-strided
    cache and `forward_mqa` reads the top-k buffer's request-local positions through the
    block table: result equals the dense reference over the selected positions."""
    rng, seq_lens, bt, cache, toks, B = _setup_requests(seed=3)
    cache.fill_(float("nan"))  # everything forward_mqa may read must be written first
    impl = _impl()
    H = impl.num_heads
    g = torch.Generator().manual_seed(4)

    # write every position of every request, plus a padded -1 slot that must be skipped
    kv_c, k_pe, slot_mapping, where = [], [], [], []
    for r, L in enumerate(seq_lens):
        for p in range(L):
            kv_c.append(torch.randn(D_LATENT, generator=g))
            k_pe.append(torch.randn(1, D_ROPE, generator=g))
            slot_mapping.append(int(bt[r, p // B]) * B + p % B)
            where.append((r, p))
    kv_c.append(torch.randn(D_LATENT, generator=g))
    k_pe.append(torch.randn(1, D_ROPE, generator=g))
    slot_mapping.append(-1)
    before = cache.clone()
    impl.do_kv_cache_update(torch.stack(kv_c), torch.stack(k_pe), cache,
                            torch.tensor(slot_mapping, dtype=torch.int64), "auto", None)
    for i, (r, p) in enumerate(where):
        row = cache[int(bt[r, p // B]), p % B]
        assert torch.equal(row[:D_LATENT], kv_c[i]) and torch.equal(row[D_LATENT:], k_pe[i][0])
    written = {(int(bt[r, p // B]), p % B) for r, p in where}
    for blk in range(cache.shape[0]):
        for off in range(B):
            if (blk, off) not in written:
                assert torch.isnan(cache[blk, off]).all() and torch.isnan(before[blk, off]).all()

    K = 16
    sel = _random_selections([p + 1 for _, p in toks], K, rng, empty_tokens={5},
                             pad_anywhere=False)
    buf = torch.full((32, K), -7, dtype=torch.int32)  # rows past T must be ignored
    buf[: len(toks)] = sel
    impl.topk_indices_buffer = buf
    md = CpuSparseMLAMetadata(
        num_reqs=len(seq_lens), max_query_len=8, max_seq_len=max(seq_lens),
        num_actual_tokens=len(toks), query_start_loc=torch.zeros(4, dtype=torch.int32),
        slot_mapping=torch.zeros(len(toks), dtype=torch.int64), block_table=bt,
        req_id_per_token=torch.tensor([r for r, _ in toks], dtype=torch.int32),
        block_size=B, topk_tokens=K, num_decode_tokens=len(toks),
    )
    ql_nope = torch.randn(len(toks), H, D_LATENT, generator=g)
    q_pe = torch.randn(len(toks), H, D_ROPE, generator=g)
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache, md, layer=None)
    q = torch.cat([ql_nope, q_pe], dim=-1)
    for t, (r, _) in enumerate(toks):
        chosen = [p for p in sel[t].tolist() if p >= 0]
        if not chosen:
            assert torch.equal(out[t], torch.zeros(H, D_LATENT))
            continue
        kv = torch.stack([cache[int(bt[r, p // B]), p % B] for p in chosen])
        ref, _ = _dense_reference(q[t], kv, impl.scale, D_LATENT)
        torch.testing.assert_close(out[t].double(), ref, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# unit: indexer


def test_indexer_key_cache_round_trip():
    B, stride_bytes_rows, nblocks, n = 16, 20, 6, 45
    base = torch.zeros(nblocks, stride_bytes_rows, 132, dtype=torch.uint8)
    cache = base[:, :B]  # block-strided like a view into a bigger allocation
    g = torch.Generator().manual_seed(0)
    # magnitudes spanning several decades, per token
    k = torch.randn(n + 1, 128, generator=g) * torch.logspace(-3, 2, n + 1).unsqueeze(1)
    k[3, :64] *= 1e-4  # small values next to large ones within one group: subnormal range
    block_row = torch.tensor([4, 0, 2, 5], dtype=torch.int32)
    slots = torch.tensor([int(block_row[p // B]) * B + p % B for p in range(n)] + [-1])
    cpu_indexer.write_keys(cache, k, slots)
    back = cpu_indexer.read_keys(cache, block_row, n)
    assert back.shape == (n, 128) and back.dtype == torch.float32
    x = k[:n]
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True) / 448.0)))
    # e4m3 round-to-nearest: half an ulp is <= |x| / 16 for normals, scale * 2^-10 for
    # subnormals; anything beyond that (wrong slot, wrong scale, wrong layout) is far larger
    bound = x.abs() / 16 + scale * 2.0 ** -10 + 1e-30
    assert ((back - x).abs() <= bound).all()
    rel = (back - x).norm(dim=-1) / x.norm(dim=-1)
    assert rel.max() < 0.05
    # the -1 slot was skipped, block 1 and 3 (not in the table) untouched, gap rows untouched
    assert base[1].eq(0).all() and base[3].eq(0).all() and base[:, B:].eq(0).all()
    # key quantization matches the torch stand-in used for the query side (ue8m0 scales)
    q1, s1 = cpu_indexer.quant_fp8_ue8m0(x)
    q2, s2 = cpu_indexer.per_token_group_quant_fp8_torch(x, 128, use_ue8m0=True)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(s1, s2.reshape(s1.shape))


def _brute_topk(q, w, keys, pos, k):
    """float64 loops: list of selected positions per query (order: best first)."""
    out = []
    for i in range(q.shape[0]):
        scores = []
        for s in range(int(pos[i]) + 1):
            v = sum(float(w[i, h]) * max(0.0, float(q[i, h].double() @ keys[s].double()))
                    for h in range(q.shape[1]))
            scores.append((v, s))
        scores.sort(key=lambda t: (-t[0], t[1]))
        out.append(scores[: min(k, len(scores))])
    return out


@pytest.mark.parametrize("chunk", [256, 5])
def test_select_topk_equals_brute_force(monkeypatch, chunk):
    monkeypatch.setattr(cpu_indexer, "SCORE_CHUNK", chunk)
    g = torch.Generator().manual_seed(7)
    L, H, D, k = 40, 3, 16, 16
    keys = torch.randn(L, D, generator=g)
    # a prefill of the first 13 positions (prefix < k: -1 padded) and later tokens (> k)
    positions = torch.tensor(list(range(13)) + [15, 16, 25, 39])
    n = positions.numel()
    q = torch.randn(n, H, D, generator=g)
    w = torch.randn(n, H, generator=g).abs()
    w[:, 0] *= -1  # negative head weights occur in real indexers
    out = cpu_indexer.select_topk(q, w, keys, positions, k)
    assert out.shape == (n, k) and out.dtype == torch.int32
    ref = _brute_topk(q, w, keys, positions, k)
    for i in range(n):
        row = out[i].tolist()
        want = ref[i]
        m = len(want)
        assert m == min(k, int(positions[i]) + 1)
        assert row[m:] == [-1] * (k - m), (i, row)
        got = row[:m]
        assert len(set(got)) == m and all(0 <= p <= int(positions[i]) for p in got)
        # the same set of positions as the float64 brute force
        if sorted(got) != sorted(s for _, s in want):
            kth = want[-1][0]
            pytest.fail(f"query {i} (pos {int(positions[i])}): {sorted(got)} != "
                        f"{sorted(s for _, s in want)} (k-th score {kth})")


# --------------------------------------------------------------------------------------------
# end to end in vLLM

PROMPT_LENS = [5, 12, 37, 130, 300, 450]  # < 512 - MAX_TOKENS: index_topk 512 covers all
MAX_TOKENS = 16
NUM_LOGPROBS = 5
# Dense MLA (MHA prefill, value up-projection before attention) and the sparse path (absorbed
# MQA for every token) are the same function in different float32 association orders: measured
# max |diff| 4.8e-6 over ~930 prompt positions. 1e-4 leaves 20x headroom and is still four
# orders of magnitude below what a single changed selection does (0.1 - 3 nats, see test b).
LOGPROB_ATOL = 1e-4


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in PROMPT_LENS]


def e2e_llm_kwargs(name: str) -> dict:
    """What each e2e engine pins instead of taking its host's defaults. All of them: the
    reference MLA path's schedule (block 16, no chunked prefill, no prefix caching, 2048-token
    steps: the six prompts, 934 tokens, prefill in one step, and a repeated prompt is computed
    afresh), the schedule every comparison here was verified with; on a host with AMX tiles a
    DSA model would otherwise get block 128, chunked prefill and prefix caching. The dense twin
    also pins vLLM's reference CPU_MLA kernel: with AMX tiles vLLM would pick AMX_MLA, which
    refuses its float32 weights."""
    from _vllm_subprocess import DENSE_MLA_LLM_KWARGS, mla_path_kwargs

    kw = mla_path_kwargs("reference", max_model_len=1024)  # sparse_e2e.py's max_model_len
    if name == "dense":
        kw["attention_backend"] = DENSE_MLA_LLM_KWARGS["attention_backend"]
    return kw


def _run_e2e(model: Path, batch_checks: bool, llm_kwargs: dict, timeout=400,
             env_extra: dict | None = None) -> dict:
    from _vllm_subprocess import vllm_env

    spec = dict(prompts=_prompts(), max_tokens=MAX_TOKENS, num_logprobs=NUM_LOGPROBS,
                batch_checks=batch_checks, llm_kwargs=llm_kwargs)
    # The harness's engine environment (no VLLM_CPU_KVCACHE_SPACE, no test-process flags
    # such as TRITON_INTERPRET, the checkout on PYTHONPATH); the engine runs in-process so
    # the script's hooks see the model.
    env = vllm_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env_extra or {})})
    proc = subprocess.run(
        [sys.executable, str(E2E_SCRIPT), "--model", str(model), "--spec", json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=str(model.parent))
    lines = [l[len(MARK):] for l in proc.stdout.splitlines() if l.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"{E2E_SCRIPT.name} on {model.name} exited {proc.returncode}\n"
                             f"--- stdout ---\n{proc.stdout[-4000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def e2e_models(request, tmp_path_factory):
    """DSA index_topk 512, the same weights with index_topk 16, and their dense-MLA twin.
    Uses the session's cached `tiny_model` factory when conftest provides one."""
    try:
        tiny = request.getfixturevalue("tiny_model")
    except pytest.FixtureLookupError:
        tiny = None
    if tiny is not None:
        full = tiny("deepseek_v32", index_topk=512)
        sparse = tiny("deepseek_v32", weights_from=full)
        dense = tiny("deepseek_v3", weights_from=full)
    else:
        from ulacache_vllm.models import build_model

        d = tmp_path_factory.mktemp("sparse_e2e")
        full = build_model("deepseek_v32", d / "dsa_topk512", overrides={"index_topk": 512})
        sparse = build_model("deepseek_v32", d / "dsa_topk16", weights_from=full)
        dense = build_model("deepseek_v3", d / "dense_mla", weights_from=full)
    assert json.loads((sparse / "config.json").read_text())["index_topk"] == 16
    return {"full": full, "sparse": sparse, "dense": dense}


@pytest.fixture(scope="module")
def e2e(e2e_models):
    """The three engines' JSON results, run at the first test that asks for one: two lanes side
    by side (``side_by_side_binds``: each lane's engines on CPUs of their own, the same number
    of compute threads in every engine; one lane after the other on a single CPU), the sparse
    model (its batch checks make it the longest) in one, the full-top-k model and the dense
    twin in the other."""
    cache: dict[str, dict | Exception] = {}

    def get(name: str) -> dict:
        from _vllm_subprocess import require_engine_marker, run_side_by_side

        require_engine_marker()
        if not cache:
            def lane(*names):
                def run(bind):
                    for n in names:
                        try:
                            cache[n] = _run_e2e(e2e_models[n], batch_checks=(n == "sparse"),
                                                llm_kwargs=e2e_llm_kwargs(n), env_extra=bind)
                        except Exception as e:  # noqa: BLE001 - raised by the tests that read it
                            cache[n] = e
                return run
            run_side_by_side(lane("sparse"), lane("full", "dense"), in_process=True)
        if isinstance(cache[name], Exception):
            raise cache[name]
        return cache[name]

    return get


def _prompt_diffs(a, b, same_top=True):
    """Per prompt: |diff| of the actual token's logprob per position, and max |diff| over the
    top-n tokens both runs report."""
    per_pos, top = [], 0.0
    for pa, pb in zip(a["prompt_lp"], b["prompt_lp"]):
        assert len(pa) == len(pb)
        per_pos.append([abs(x[0] - y[0]) for x, y in zip(pa, pb)])
        for x, y in zip(pa, pb):
            common = set(x[1]) & set(y[1])
            if same_top:  # top-n sets agree up to a near tie at the n-th place
                assert len(common) >= NUM_LOGPROBS - 1
            top = max([top] + [abs(x[1][t] - y[1][t]) for t in common])
    return per_pos, top


@pytest.mark.engine
def test_e2e_engines_run_the_pinned_schedule(e2e):
    """Each e2e engine resolved the schedule its comparisons were verified with, whatever
    this host's defaults (``e2e_llm_kwargs``)."""
    for name in ("full", "sparse", "dense"):
        got = e2e(name)["config"]
        assert (got["block"], got["chunked"], got["prefix"], got["batched"]) == \
            (16, False, False, 2048), (name, got)
        assert ("CPU_MLA" in got["backend"]) == (name == "dense"), (name, got)


@pytest.mark.engine
def test_e2e_topk_covering_context_matches_dense_mla(e2e):
    full, dense = e2e("full"), e2e("dense")
    st = full["select"]
    # every indexer row selected exactly the whole causal prefix, over long contexts too
    assert st["topk"] == 512 and st["rows"] > 900 and st["bad_rows"] == 0
    assert st["rows_full_prefix"] == st["rows"] and st["max_prefix"] >= max(PROMPT_LENS)
    assert st["attn_calls"] > 0 and st["attn_dup_rows"] == 0
    assert st["attn_max_valid"] >= max(PROMPT_LENS)
    assert dense["select"]["topk_calls"] == 0  # the dense twin really is dense

    per_pos, top = _prompt_diffs(full, dense)
    worst = max(max(p) for p in per_pos if p)
    print(f"\nDSA(topk 512) vs dense MLA: prompt logprob max|diff| {worst:.3g}, "
          f"top-{NUM_LOGPROBS} {top:.3g}")
    assert worst <= LOGPROB_ATOL and top <= LOGPROB_ATOL

    gen_max = 0.0
    for ga, gb in zip(full["gen"], dense["gen"]):
        assert len(ga) == MAX_TOKENS
        for (ta, la), (tb, lb) in zip(ga, gb):
            common = set(la) & set(lb)
            gen_max = max([gen_max] + [abs(la[t] - lb[t]) for t in common])
            if ta != tb:  # only a near tie may flip greedy; afterwards contexts differ
                assert abs(la[str(ta)] - la.get(str(tb), -1e9)) < 10 * LOGPROB_ATOL
                break
    print(f"DSA(topk 512) vs dense MLA: generated-token logprob max|diff| {gen_max:.3g}")
    assert gen_max <= LOGPROB_ATOL
    assert [[t for t, _ in g] for g in full["gen"]] == [[t for t, _ in g] for g in dense["gen"]]


@pytest.mark.engine
def test_e2e_small_topk_is_really_sparse(e2e):
    sparse, full = e2e("sparse"), e2e("full")
    st = sparse["select"]
    assert st["topk"] == 16 and st["bad_rows"] == 0
    # rows whose prefix exceeds 16 chose 16 distinct causal positions; shorter prefixes all
    assert st["rows_sparse"] > 0.8 * st["rows"] and st["rows_full_prefix"] > 0
    assert st["rows_sparse"] + st["rows_full_prefix"] == st["rows"]
    assert st["max_prefix"] >= max(PROMPT_LENS) > 16
    # attention consumed 16-wide rows with 16 distinct entries
    assert st["attn_width"] == 16 and st["attn_max_valid"] == 16 and st["attn_dup_rows"] == 0
    assert st["attn_rows"] == st["rows"] and st["attn_rows_with_k_valid"] >= st["rows_sparse"]

    per_pos, _ = _prompt_diffs(sparse, full, same_top=False)
    # position j predicts token j+1 from a prefix of j+1 <= 16 tokens: selection is the same
    early = max(max(p[:16]) for p in per_pos if p)
    late = max(max(p[16:]) for p in per_pos if len(p) > 16)
    print(f"\nDSA topk 16 vs topk 512: prefix <= 16 max|diff| {early:.3g}, "
          f"longer prefixes max|diff| {late:.3g}")
    assert early <= 1e-5
    assert late > 0.05  # the sparse selection changed the results: not silently dense
    for p, n in zip(per_pos, PROMPT_LENS):
        if n > 64:
            assert max(p[32:]) > 1e-3


@pytest.mark.engine
def test_e2e_sparse_deterministic_and_batch_invariant(e2e):
    sparse = e2e("sparse")
    run1, run2 = sparse["batched"]
    assert len(run1) == len(PROMPT_LENS) >= 4
    assert all(len(t) == MAX_TOKENS for t in run1)
    assert run1 == run2, "greedy generation differs between two identical runs"
    assert sparse["single"] == run1, "single-request and batched greedy tokens differ"
    # the logprob pass (prompt_logprobs + logprobs requested) generated the same tokens
    assert [[t for t, _ in g] for g in sparse["gen"]] == run1
