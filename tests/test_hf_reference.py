"""An independent reference for the tiny DSA models: vLLM's output against HF transformers.

Parity tests (stock vs ulacache) prove the two backends agree; they cannot catch a bug both
share (the CPU sparse-MLA backend, the CPU indexer, the rotary fix, the KV cache writes). Here
the tiny DeepSeek-V3.2 and GLM DSA models also run through transformers' own modelling
(``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``, float32, eager attention, one full
forward over prompt + generated tokens, no KV cache), and vLLM is checked against it in two
parts, each with a stated tolerance:

1. **The indexer's selection.** vLLM's top-k (recorded for every layer and query position:
   the engine runs in-process and the script wraps the CPU indexer's ``select_topk``) must be
   a top-k of the reference indexer's scores: where the context is at most ``index_topk`` (16)
   every earlier position; beyond, 16 distinct causal positions whose lowest reference score is
   at least the highest unselected one minus ``SELECT_TOL`` x the row's largest |score| (room
   for near-ties), and at least 95 % of the rows exactly the reference's top-k set. The
   reference scores are transformers' indexer (its projections, norm and rope) with q and k
   rounded to fp8 e4m3 with power-of-two scales per 128 values, as DeepSeek's reference
   inference and vLLM 0.32 (``scale_fmt = "ue8m0"``) score them; transformers itself scores in
   full precision ("fp8 is a precision optimization, we skip [it]"), which picks a different
   set in ~30 % of these rows and moves logprobs by up to ~1 (random tiny weights: flat
   scores). The rounding is written here from the model's definition, not taken from the
   project's indexer.
2. **Everything else** (MLA over the selected rows, rope, MoE, norms, logits): transformers'
   model attends over vLLM's selections (its indexer returns them, after scoring as above);
   every prompt logprob (``prompt_logprobs=0``) and generated-token logprob vLLM reports must
   be within ``TOL`` of the reference, and each greedy token must be the reference's argmax
   wherever the reference's top-2 margin exceeds ``TOL`` (flat tiny models: a near-tie may go
   either way; the reference is teacher-forced with vLLM's tokens, so a tie does not end the
   comparison).

Prompts of 5, 56 and 140 tokens with 8 generated tokens: the first dense (< 16 positions), the
others really sparse (top-16 of up to 147). One subprocess per model (the two side by side) runs
its three engines (stock, then ``kv_backend="ulacache"`` twice, the same prompts, one prompt at
a time so each indexer call belongs to one request); the ulacache runs are checked against the
reference too, and against stock token for token. The first ulacache run has room for everything on the device
(its identity-placement fast path). The second ("ulacache_tiered") has a 96-slot device pool
and a host pool of one max_model_len request: the longer prompts outgrow the device, rows are
demoted to the host and selected ones promoted back (its counters are checked), so the tiered
path meets the reference too. A device pool that small only fits a step with chunked prefill
(a step's new tokens + index_topk must fit on the device; without it vLLM's CPU build fixes
MLA's step at 2048 tokens), so that run prefills in 64-token chunks (block 16, no prefix
caching, as the others). Measured here: logprob |diff| <= 2.5e-5, selections equal to the
reference's top-k in every row but one per GLM prompt (a near-tie, gap 4e-5 of the row scale).
"""
from __future__ import annotations

import math

import pytest

from _vllm_subprocess import (BASE_LLM_KWARGS, MLA_LLM_KWARGS, mla_path_kwargs,
                              run_side_by_side, run_vllm_script)
from ulacache_vllm.models.corpus import CORPUS

pytestmark = pytest.mark.engine  # boots vLLM (two subprocesses side by side, three engines each)

TOL = 5e-4  # logprob abs diff, float32 on both sides (measured <= 2.5e-5)
SELECT_TOL = 1e-3  # near-tie room in the top-k, relative to the row's largest |score|
MODELS = ("deepseek_v32", "glm_dsa")
RUNS = ("stock", "ulacache", "ulacache_tiered")
# The tiered run (fp32 tiny DSA models: 4608 B/token of MLA rows over 2 layers, 264 B of
# indexer keys): 0.0045 GiB holds 1040 host tokens (one request of max_model_len 1024, in whole
# 16-token blocks) and 770 kB then leaves 96 device slots: a 64-token chunk + index_topk fits,
# the 140-token prompt does not.
TIERED = dict(kv_cache_memory_bytes=770_000, ula_host_pool_gib=0.0045,
              enable_chunked_prefill=True, max_num_batched_tokens=64)
MAX_TOKENS = 8
_LINES = CORPUS.splitlines()
PROMPTS = ["The quick answer is",  # 5 tokens: every position dense (< index_topk)
           " ".join(_LINES[4:7]),  # 56 tokens
           " ".join(_LINES[:7])]  # 140 tokens

_SCRIPT = """
import gc
import time
from vllm import LLM, SamplingParams
from ulacache_vllm.engine.dsa import cpu_indexer

calls = []  # (query positions, selected positions) per indexer call, in call order
orig = cpu_indexer.select_topk

def select_topk(q, weights, keys, positions, topk, *a, **kw):
    out = orig(q, weights, keys, positions, topk, *a, **kw)
    calls.append((positions.tolist(), out.tolist()))
    return out

cpu_indexer.select_topk = select_topk
sp = SamplingParams(temperature=0.0, max_tokens=ARGS["max_tokens"], ignore_eos=True,
                    logprobs=1, prompt_logprobs=0)
out = {}
for model, label, kw in ARGS["runs"]:
    t0 = time.perf_counter()
    llm = LLM(model=model, **kw)
    res = []
    for prompt in ARGS["prompts"]:  # one at a time: every indexer call is this prompt's
        calls.clear()
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        c = o.outputs[0]
        res.append(dict(
            prompt_ids=list(o.prompt_token_ids),
            prompt_lp=[None if d is None else d[t].logprob
                       for d, t in zip(o.prompt_logprobs, o.prompt_token_ids)],
            ids=list(c.token_ids),
            lp=[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
            select=list(calls)))
    usage = llm.collective_rpc("ulacache_usage")[0] if kw.get("kv_backend") == "ulacache" else None
    out.setdefault(model, {})[label] = dict(outputs=res, seconds=time.perf_counter() - t0,
                                            usage=usage)
    del llm
    gc.collect()
emit(out)
"""


@pytest.fixture(scope="module")
def vllm_outputs(tiny_model) -> dict:
    """{model name: {run: {"outputs": per prompt {...}, "seconds", "usage"}}}, a subprocess per
    model ("usage": the ulacache runs' ``ulacache_usage`` after their last prompt)."""
    # The reference MLA path's schedule on every host (block 16, no chunked prefill or
    # prefix caching), the one the tolerances were measured on: with AMX tiles vLLM would
    # give these DSA models block 128, chunked prefill and (stock) prefix caching.
    base = {**BASE_LLM_KWARGS, **MLA_LLM_KWARGS, "dtype": "float32",
            **mla_path_kwargs("reference", BASE_LLM_KWARGS["max_model_len"])}
    kws = {"stock": base,
           "ulacache": {**base, "kv_backend": "ulacache", "ula_host_pool_gib": 0.006},
           "ulacache_tiered": {**base, "kv_backend": "ulacache", **TIERED}}
    paths = {name: str(tiny_model(name)) for name in MODELS}

    def model_runs(name):
        # in-process engines (no engine-core process): the selections are recorded in the
        # script; one interpreter per model, the two side by side (``run_side_by_side``:
        # CPUs of their own, the same number of compute threads)
        runs = [(paths[name], label, kws[label]) for label in RUNS]
        return lambda bind: run_vllm_script(
            _SCRIPT, args=dict(prompts=PROMPTS, max_tokens=MAX_TOKENS, runs=runs),
            timeout=1200, env=bind)[paths[name]]

    return dict(zip(MODELS, run_side_by_side(*map(model_runs, MODELS), in_process=True)))


# --------------------------------------------------------------------------------------------
# the reference


def _fp8_round(x, group: int = 128):
    """fp8 e4m3 quantize + dequantize per ``group`` values with a power-of-two scale
    (rounded up), as DeepSeek's reference indexer scores q and k."""
    import torch

    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / fmax
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return ((g / scale).clamp(-fmax, fmax).to(fp8).float() * scale).reshape(x.shape)


class Reference:
    """transformers' model for one DSA checkpoint, float32, whose indexers score with fp8
    rounding and return the selection given to ``forward`` (vLLM's), keeping their scores."""

    def __init__(self, path):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        name = type(self.model).__name__
        if name == "DeepseekV32ForCausalLM":
            from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m
            indexer, self.rope = m.DeepseekV32Indexer, m.apply_rotary_pos_emb  # half-split
        elif name == "GlmMoeDsaForCausalLM":
            from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m
            indexer, self.rope = m.GlmMoeDsaIndexer, m.apply_rotary_pos_emb_interleave
        else:
            raise AssertionError(f"not a DSA model: {name}")
        self.indexers = [mod for mod in self.model.modules() if isinstance(mod, indexer)]
        assert len(self.indexers) == self.model.config.num_hidden_layers
        self.topk = self.model.config.index_topk
        for layer, mod in enumerate(self.indexers):
            mod.forward = self._indexer_forward(layer).__get__(mod)
        self.selected = self.scores = None

    def _indexer_forward(self, layer: int):
        import torch
        import torch.nn.functional as F

        ref = self

        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                    position_ids=None, past_key_values=None):
            assert past_key_values is None  # one full forward, no cache
            b, s, _ = hidden_states.shape
            cos, sin = position_embeddings
            r = self.qk_rope_head_dim
            q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
            k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
            q_rot, k_rot = ref.rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
            q = _fp8_round(torch.cat([q_rot, q[..., r:]], dim=-1))
            k = _fp8_round(torch.cat([k_rot, k[..., r:]], dim=-1).squeeze(2))
            scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1))
                            * self.softmax_scale)
            w = self.weights_proj(hidden_states).float() * self.n_heads ** -0.5
            ref.scores[layer] = torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)[0]
            return ref.selected[layer].unsqueeze(0)

        return forward

    def run(self, ids: list[int], selected):
        """Log-probabilities [len(ids), vocab] (row j: token j + 1) attending over
        ``selected`` (per layer [len(ids), topk] positions); fills ``self.scores``."""
        import torch

        self.selected, self.scores = selected, [None] * len(self.indexers)
        with torch.no_grad():
            logits = self.model(torch.tensor([ids]), use_cache=False).logits[0].double()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def references(tiny_model) -> dict:
    return {name: Reference(tiny_model(name)) for name in MODELS}


def _selections(out: dict, n_layers: int, topk: int, seq_len: int):
    """vLLM's recorded selections as per-layer [seq_len, topk] tensors (-1 padding replaced
    by the query's own position, which attention reads anyway); checks every position but the
    last was selected for once per layer (the last token is never fed back)."""
    import torch

    sel = [torch.arange(seq_len).unsqueeze(1).repeat(1, topk).int() for _ in range(n_layers)]
    seen = [set() for _ in range(n_layers)]
    calls = out["select"]
    assert len(calls) % n_layers == 0
    for c, (positions, rows) in enumerate(calls):
        layer = c % n_layers  # one request per step: one call per layer, in layer order
        assert positions == calls[c - layer][0], "calls of one step differ in positions"
        for q, row in zip(positions, rows):
            assert q not in seen[layer], f"position {q} selected twice in layer {layer}"
            seen[layer].add(q)
            sel[layer][q] = torch.tensor([x if x >= 0 else q for x in row], dtype=torch.int32)
    assert all(s == set(range(seq_len - 1)) for s in seen), "positions without a selection"
    return sel


def _check_selection(out: dict, scores, topk: int) -> tuple[int, int]:
    """Part 1 for one prompt; returns (rows exactly the reference top-k, rows beyond topk)."""
    exact = sparse_rows = 0
    for layer, sc in enumerate(scores):
        for q, raw in enumerate(_recorded_rows(out, layer, len(scores))):
            picked = [x for x in raw if x >= 0]
            if q + 1 <= topk:  # dense: every earlier position, -1 padded
                assert sorted(picked) == list(range(q + 1)), (layer, q, raw)
                continue
            sparse_rows += 1
            assert len(set(picked)) == topk and all(0 <= x <= q for x in picked), (layer, q)
            row = sc[q, : q + 1]
            unpicked = sorted(set(range(q + 1)) - set(picked))
            gap = row[unpicked].max().item() - row[picked].min().item()
            assert gap <= SELECT_TOL * row.abs().max().item(), \
                f"layer {layer} position {q}: not a top-{topk} (score gap {gap:.3g})"
            exact += set(row.topk(topk).indices.tolist()) == set(picked)
    return exact, sparse_rows


def _recorded_rows(out: dict, layer: int, n_layers: int):
    """The recorded rows of ``layer`` in position order."""
    rows = {}
    for c, (positions, sel) in enumerate(out["select"]):
        if c % n_layers == layer:
            rows.update(zip(positions, sel))
    return [rows[q] for q in sorted(rows)]


def _check_logprobs(out: dict, ref_lp) -> dict:
    """Part 2 for one prompt: logprobs within TOL, greedy tokens where the margin allows."""
    P, gen = len(out["prompt_ids"]), out["ids"]
    diffs = [abs(out["prompt_lp"][j] - ref_lp[j - 1, out["prompt_ids"][j]].item())
             for j in range(1, P)]
    near_ties = 0
    for i, (tok, lp) in enumerate(zip(gen, out["lp"])):
        row = ref_lp[P + i - 1]
        diffs.append(abs(lp - row[tok].item()))
        top2 = row.topk(2)
        margin = (top2.values[0] - top2.values[1]).item()
        if tok != top2.indices[0].item():
            near_ties += 1
            assert margin <= TOL, (f"generated token {i}: vLLM {tok}, reference argmax "
                                   f"{top2.indices[0].item()} by a margin of {margin:.3g}")
    assert all(math.isfinite(d) for d in diffs)
    worst = max(diffs)
    assert worst <= TOL, f"a logprob differs from the reference by {worst:.3g} > {TOL}"
    return dict(max_diff=worst, near_ties=near_ties)


def _tier_moves(run: dict) -> dict:
    """The tiered run's store moved rows: demoted to the host and promoted back."""
    u = run["usage"]
    t = u["totals"]
    assert t["demotions"] > 0 and t["promotions"] > 0, ("the tiered run moved no rows", u)
    return dict(demotions=t["demotions"], promotions=t["promotions"])


@pytest.mark.parametrize("name", MODELS)
def test_vllm_matches_transformers_reference(name, vllm_outputs, references):
    ref = references[name]
    assert ref.topk == 16
    n_layers = len(ref.indexers)
    # The tiered run met the reference on the tiered path: rows really went to the host and
    # selected ones came back (checked first: a run on the fast path is not a tiered run).
    moves = _tier_moves(vllm_outputs[name]["ulacache_tiered"])
    for label in RUNS:
        outs = vllm_outputs[name][label]["outputs"]
        assert [len(o["ids"]) for o in outs] == [MAX_TOKENS] * len(PROMPTS)
        assert max(len(o["prompt_ids"]) for o in outs) > 4 * ref.topk  # really sparse
        exact = rows = 0
        figs = []
        for o in outs:
            ids = o["prompt_ids"] + o["ids"]
            sel = _selections(o, n_layers, ref.topk, len(ids))
            ref_lp = ref.run(ids, sel)
            e, r = _check_selection(o, ref.scores, ref.topk)
            exact, rows = exact + e, rows + r
            figs.append(_check_logprobs(o, ref_lp))
        print(f"\n{name} {label}: max |dlogprob| {max(f['max_diff'] for f in figs):.2e}, "
              f"near-tie tokens {sum(f['near_ties'] for f in figs)}, selections equal to the "
              f"reference top-k in {exact}/{rows} sparse rows"
              + (f"; {moves}" if label == "ulacache_tiered" else ""))
        assert rows > 300 and exact >= 0.95 * rows, (exact, rows)


@pytest.mark.parametrize("name", MODELS)
def test_ulacache_equals_stock_on_the_reference_prompts(name, vllm_outputs, references):
    """The same prompts through ulacache: the same tokens, selections and (float32, same
    numerics) the same logprobs as stock. The tiered run prefills in chunks (its indexer
    calls cover other position ranges): per layer and position the same selected set."""
    stock, ula, tiered = (vllm_outputs[name][label]["outputs"] for label in RUNS)
    for s, u in zip(stock, ula):
        assert (u["prompt_ids"], u["ids"], u["select"]) == (s["prompt_ids"], s["ids"],
                                                            s["select"])
        assert max(abs(a - b) for a, b in zip(s["lp"], u["lp"])) <= 1e-5
    _tier_moves(vllm_outputs[name]["ulacache_tiered"])
    n_layers = len(references[name].indexers)
    for s, t in zip(stock, tiered):
        assert (t["prompt_ids"], t["ids"]) == (s["prompt_ids"], s["ids"])
        for layer in range(n_layers):
            rows = [_recorded_rows(o, layer, n_layers) for o in (s, t)]
            assert [sorted(r) for r in rows[0]] == [sorted(r) for r in rows[1]], layer
        assert max(abs(a - b) for a, b in zip(s["lp"], t["lp"])) <= 1e-5
