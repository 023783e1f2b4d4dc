"""LAB-ONLY pure-PyTorch emulation of DeepSeek-V4 CPU ops (mHC + MoE routing).

Emulates these ``torch.ops._C`` ops, which only exist in vLLM's AVX512-BF16
CPU build (sgl-kernels ``csrc/cpu/sgl-kernels/mhc.cpp`` and ``topk.cpp``;
schemas from ``csrc/cpu/torch_bindings.cpp``):

* ``hc_pre_fused_cpu``  -- mHC pre block (RMS-scaled mix GEMM, sigmoid gates,
  softmax + Sinkhorn on the comb matrix, pre-gated stream reduction).
* ``hc_post_fused_cpu`` -- mHC post block (post-gated x + comb-mixed residual).
* ``hc_head_fused_cpu`` -- HC head reduction (sigmoid gates, stream reduction).
* ``biased_topk_cpu``   -- flat (non-grouped) bias-corrected top-k routing.
* ``hash_topk_cpu``     -- hash-routed-layer routing (ids given by tid2eid).

Never part of the product; registration is done by the caller from ``OPS``.
"""

from __future__ import annotations

import torch

from . import _selfcheck

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

# The real routing kernels only instantiate (num_experts, routed_topk) pairs
# from a fixed table and TORCH_CHECK-fail on anything else.  The emulation is
# generic by default (handy for tiny lab models); set True to reproduce the
# kernel's shape rejection exactly.
STRICT_ROUTING_SHAPES = False

_BIASED_TOPK_SHAPES = {64: (6, 8), 128: (6, 8), 256: (6, 8, 9), 384: (6, 8)}
_HASH_TOPK_SHAPES = {64: (6, 7, 8), 128: (6, 7, 8), 256: (6, 7, 8), 384: (6, 7, 8)}

# Token chunk for the mHC ops (bounds the fp32 working copy of x).
_MHC_TOKEN_CHUNK = 256

_REDUCED_FLOAT = (torch.bfloat16, torch.float16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


# ---------------------------------------------------------------------------
# mHC ops (mhc.cpp)
# ---------------------------------------------------------------------------

_HC_PRE_SCHEMA = (
    "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, "
    "Tensor hc_base, int hc_mult, int sinkhorn_iters, float rms_eps, "
    "float hc_eps) -> (Tensor, Tensor, Tensor)"
)


def _inv_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """[t, K] fp32 -> [t, 1] fp32; the kernel reduces sum(x^2) in double."""
    sq = xf.square().sum(dim=-1, keepdim=True, dtype=torch.float64)
    return torch.rsqrt(sq / xf.shape[-1] + float(eps)).to(torch.float32)


def _sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb_logits [t, hc, hc] fp32 (row-major: [t, r, c]).

    Mirrors ``sinkhorn_inplace``: row softmax (exp(v - rowmax) / rowsum) + eps,
    column-normalise by (colsum + eps); then (iters - 1) times
    row /= (rowsum + eps), col /= (colsum + eps).  The first iteration always
    runs (also for iters <= 0).
    """
    m = torch.softmax(comb_logits, dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(int(iters) - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def hc_pre_fused_cpu(x, hc_fn, hc_scale, hc_base, hc_mult, sinkhorn_iters, rms_eps, hc_eps):
    hc = int(hc_mult)
    _check(hc >= 2, "hc_pre_fused_cpu: hc_mult must be >= 2")
    _check(
        x.dim() == 3 and x.dtype in _REDUCED_FLOAT,
        "hc_pre_fused_cpu: x must be bf16/fp16 [T, hc, d]",
    )
    _check(hc_fn.dtype == torch.float32, "hc_pre_fused_cpu: hc_fn must be float32")
    _check(
        hc_scale.dtype == torch.float32 and hc_scale.numel() == 3,
        "hc_pre_fused_cpu: hc_scale must be float32 [3]",
    )
    _check(hc_base.dtype == torch.float32, "hc_pre_fused_cpu: hc_base must be float32")
    T, d = x.shape[0], x.shape[2]
    hc_d = hc * d
    mix_hc = (2 + hc) * hc
    _check(T > 0 and d > 0, "hc_pre_fused_cpu: T and d must be positive")
    _check(x.shape[1] == hc, "hc_pre_fused_cpu: x shape must be [T, hc_mult, d]")
    _check(
        hc_fn.dim() == 2 and hc_fn.shape[0] == mix_hc and hc_fn.shape[1] == hc_d,
        "hc_pre_fused_cpu: hc_fn must be [mix_hc, hc_mult*d]",
    )
    _check(hc_base.numel() == mix_hc, "hc_pre_fused_cpu: hc_base.numel() must equal mix_hc")
    _check(
        x.is_contiguous() and hc_fn.is_contiguous() and hc_scale.is_contiguous()
        and hc_base.is_contiguous(),
        "hc_pre_fused_cpu: x/hc_fn/hc_scale/hc_base must be contiguous",
    )

    y = torch.empty((T, d), dtype=x.dtype, device=x.device)
    post = torch.empty((T, hc), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, hc, hc), dtype=torch.float32, device=x.device)

    s = hc_scale.reshape(3)
    base = hc_base.reshape(mix_hc)
    eps = float(hc_eps)
    for t0 in range(0, T, _MHC_TOKEN_CHUNK):
        t1 = min(T, t0 + _MHC_TOKEN_CHUNK)
        xs = x[t0:t1].to(torch.float32)  # [t, hc, d]
        xf = xs.reshape(t1 - t0, hc_d)
        mixes = (xf @ hc_fn.t()) * _inv_rms(xf, rms_eps)  # [t, mix_hc]
        pre = torch.sigmoid(mixes[:, :hc] * s[0] + base[:hc]) + eps
        post[t0:t1] = 2.0 * torch.sigmoid(mixes[:, hc:2 * hc] * s[1] + base[hc:2 * hc])
        comb_logits = (mixes[:, 2 * hc:] * s[2] + base[2 * hc:]).view(-1, hc, hc)
        comb[t0:t1] = _sinkhorn(comb_logits, sinkhorn_iters, eps)
        y[t0:t1] = (pre.unsqueeze(-1) * xs).sum(dim=1).to(x.dtype)
    return y, post, comb


_HC_POST_SCHEMA = (
    "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, "
    "Tensor comb) -> Tensor"
)


def hc_post_fused_cpu(x, residual, post, comb):
    _check(
        x.dim() == 2 and x.dtype in _REDUCED_FLOAT,
        "hc_post_fused_cpu: x must be bf16/fp16 [T, d]",
    )
    _check(
        residual.dim() == 3 and residual.dtype == x.dtype,
        "hc_post_fused_cpu: residual must be same dtype as x [T, hc, d]",
    )
    _check(post.dtype == torch.float32, "hc_post_fused_cpu: post must be float32")
    _check(comb.dtype == torch.float32, "hc_post_fused_cpu: comb must be float32")
    T, d = x.shape
    hc = residual.shape[1]
    _check(hc >= 2, "hc_post_fused_cpu: hc_mult must be >= 2")
    _check(T > 0 and d > 0, "hc_post_fused_cpu: T and d must be positive")
    _check(
        residual.shape[0] == T and residual.shape[2] == d,
        "hc_post_fused_cpu: residual shape must be [T, hc, d]",
    )
    _check(
        post.dim() == 2 and post.shape[0] == T and post.shape[1] == hc,
        "hc_post_fused_cpu: post shape must be [T, hc]",
    )
    _check(
        comb.dim() == 3 and comb.shape[0] == T and comb.shape[1] == hc and comb.shape[2] == hc,
        "hc_post_fused_cpu: comb shape must be [T, hc, hc]",
    )
    _check(
        x.is_contiguous() and residual.is_contiguous() and post.is_contiguous()
        and comb.is_contiguous(),
        "hc_post_fused_cpu: x/residual/post/comb must be contiguous",
    )

    out = torch.empty((T, hc, d), dtype=x.dtype, device=x.device)
    for t0 in range(0, T, _MHC_TOKEN_CHUNK):
        t1 = min(T, t0 + _MHC_TOKEN_CHUNK)
        # out[t, h, :] = post[t, h] * x[t, :] + sum_i comb[t, i, h] * residual[t, i, :]
        mixed = torch.bmm(comb[t0:t1].transpose(1, 2), residual[t0:t1].to(torch.float32))
        mixed += post[t0:t1].unsqueeze(-1) * x[t0:t1].to(torch.float32).unsqueeze(1)
        out[t0:t1] = mixed.to(x.dtype)
    return out


_HC_HEAD_SCHEMA = (
    "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, "
    "Tensor hc_base, float hc_eps, float norm_eps) -> Tensor"
)


def hc_head_fused_cpu(x, hc_fn, hc_scale, hc_base, hc_eps, norm_eps):
    _check(
        x.dim() == 3 and x.dtype in _REDUCED_FLOAT,
        "hc_head_fused_cpu: x must be bf16/fp16 [T, hc, d]",
    )
    hc = x.shape[1]
    _check(hc >= 2, "hc_head_fused_cpu: hc_mult must be >= 2")
    _check(hc_fn.dtype == torch.float32, "hc_head_fused_cpu: hc_fn must be float32")
    _check(
        hc_scale.dtype == torch.float32 and hc_scale.numel() == 1,
        "hc_head_fused_cpu: hc_scale must be a scalar float32",
    )
    _check(hc_base.dtype == torch.float32, "hc_head_fused_cpu: hc_base must be float32")
    _check(hc_base.numel() == hc, "hc_head_fused_cpu: hc_base.numel() must equal hc_mult")
    T, d = x.shape[0], x.shape[2]
    _check(T > 0 and d > 0, "hc_head_fused_cpu: T and d must be positive")
    _check(
        hc_fn.dim() == 2 and hc_fn.shape[0] == hc and hc_fn.shape[1] == hc * d,
        "hc_head_fused_cpu: hc_fn must be [hc_mult, hc_mult*d]",
    )
    _check(
        x.is_contiguous() and hc_fn.is_contiguous() and hc_scale.is_contiguous()
        and hc_base.is_contiguous(),
        "hc_head_fused_cpu: x/hc_fn/hc_scale/hc_base must be contiguous",
    )

    y = torch.empty((T, d), dtype=x.dtype, device=x.device)
    scale = hc_scale.reshape(1)[0]
    base = hc_base.reshape(hc)
    for t0 in range(0, T, _MHC_TOKEN_CHUNK):
        t1 = min(T, t0 + _MHC_TOKEN_CHUNK)
        xs = x[t0:t1].to(torch.float32)
        xf = xs.reshape(t1 - t0, hc * d)
        dots = xf @ hc_fn.t()  # [t, hc]
        pre = torch.sigmoid(dots * _inv_rms(xf, norm_eps) * scale + base) + float(hc_eps)
        y[t0:t1] = (pre.unsqueeze(-1) * xs).sum(dim=1).to(x.dtype)
    return y


# ---------------------------------------------------------------------------
# MoE routing ops (topk.cpp)
# ---------------------------------------------------------------------------

_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK31 = (1 << 31) - 1


def _lcg_shared_ids(num_tokens: int, num_shared: int, base_id: int, device) -> torch.Tensor:
    """Shared-expert ids the kernel draws from its per-chunk LCG.

    Kernel (per at::parallel_for chunk starting at ``begin``):
        state = begin * A + C
        per token: state = state * A + C; id = base + (state >> 33) % n
    The chunking depends on the thread count; we emulate a single chunk
    (begin = 0, i.e. the 1-thread result).  Vectorised by affine-map
    exponentiation over the token index (uint64 arithmetic done in wrapping
    int64, logical shift emulated by masking).
    """
    n = torch.arange(1, num_tokens + 1, dtype=torch.int64, device=device)  # updates per token
    res_a = torch.ones_like(n)
    res_c = torch.zeros_like(n)
    pow_a = torch.tensor(_LCG_A, dtype=torch.int64, device=device)
    pow_c = torch.tensor(_LCG_C, dtype=torch.int64, device=device)
    bit = 0
    while (1 << bit) <= num_tokens:
        sel = ((n >> bit) & 1).bool()
        # compose (res) o (pow): x -> res_a * (pow_a x + pow_c) + res_c (maps commute)
        new_a = res_a * pow_a
        new_c = res_a * pow_c + res_c
        res_a = torch.where(sel, new_a, res_a)
        res_c = torch.where(sel, new_c, res_c)
        pow_c = pow_a * pow_c + pow_c
        pow_a = pow_a * pow_a
        bit += 1
    state = res_a * _LCG_C + res_c  # initial state (begin = 0) is C
    r = (state >> 33) & _MASK31
    return (base_id + r % int(num_shared)).to(torch.int32)


def _sigmoid_scores(g: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-g))


def _sqrtsoftplus_scores(g: torch.Tensor) -> torch.Tensor:
    """Kernel's sqrt(softplus(x)): log1p-free log(1 + exp(x)); x > 20 -> x;
    then sqrt; x < -15 -> exp(x / 2)."""
    sp = torch.log(1.0 + torch.exp(g))
    sp = torch.where(g > 20.0, g, sp)
    return torch.where(g < -15.0, torch.exp(g * 0.5), sp.sqrt())


def _check_routing_shape(table, name: str, num_experts: int, routed_topk: int) -> None:
    if not STRICT_ROUTING_SHAPES:
        return
    _check(num_experts in table, f"{name}: unsupported num_experts {num_experts}")
    _check(
        routed_topk in table[num_experts],
        f"{name}: unsupported routed_topk {routed_topk} for num_experts={num_experts}",
    )


def _score_fn(scoring_func: str, accepted: tuple[str, ...]):
    """The router kernel's scoring function by name (each kernel accepts its own set)."""
    fns = {"softmax": lambda g: torch.softmax(g, dim=-1), "sigmoid": _sigmoid_scores,
           "sqrtsoftplus": _sqrtsoftplus_scores}
    if scoring_func not in accepted:
        raise RuntimeError(f"Unsupported scoring_func: {scoring_func}")
    return fns[scoring_func]


_BIASED_TOPK_SCHEMA = (
    "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor "
    "correction_bias, int topk, bool renormalize, str scoring_func, int "
    "num_fused_shared_experts, float? routed_scaling_factor, bool "
    "apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)"
)


def biased_topk_cpu(
    hidden_states,
    gating_output,
    correction_bias,
    topk,
    renormalize,
    scoring_func,
    num_fused_shared_experts,
    routed_scaling_factor,
    apply_routed_scaling_factor_on_output,
):
    _check(gating_output.is_contiguous(), "gating_output must be contiguous")
    _check(correction_bias.is_contiguous(), "correction_bias must be contiguous")
    num_tokens = hidden_states.shape[0]
    num_experts = gating_output.shape[1]
    _check(gating_output.shape[0] == num_tokens, "Number of tokens mismatch")
    _check(correction_bias.numel() == num_experts, "Bias shape mismatch")
    score_fn = _score_fn(scoring_func, ("sigmoid", "sqrtsoftplus"))
    topk = int(topk)
    nfse = int(num_fused_shared_experts)
    _check_routing_shape(_BIASED_TOPK_SHAPES, "biased_topk_cpu", num_experts, topk - nfse)
    _check(0 < topk <= num_experts, f"biased_topk_cpu: topk {topk} out of range")
    rsf = float(routed_scaling_factor) if routed_scaling_factor is not None else 0.0
    # the kernel keeps routed_scaling_factor as a float
    rsf = float(torch.tensor(rsf, dtype=torch.float32).item())

    dev = hidden_states.device
    scores = score_fn(gating_output.to(torch.float32))  # [T, E]
    biased = scores + correction_bias.reshape(1, num_experts).to(torch.float32)
    # partial_sort(desc) over the full topk -> sorted descending selection.
    ids = torch.topk(biased, k=topk, dim=-1, largest=True, sorted=True)[1]
    weights = scores.gather(1, ids)  # unbiased scores as weights
    ids = ids.to(torch.int32)

    if nfse > 0:
        # last slot: random shared expert id in [E, E + nfse)
        ids[:, topk - 1] = _lcg_shared_ids(num_tokens, nfse, num_experts, dev)
        if rsf != 0.0:
            weights[:, topk - 1] = weights[:, : topk - 1].sum(dim=-1) / rsf

    if renormalize:
        norm_end = topk if nfse == 0 else topk - 1
        scale = 1.0 / weights[:, :norm_end].sum(dim=-1, keepdim=True)
        if apply_routed_scaling_factor_on_output:
            scale = scale * rsf
        # routed slots and (if present) the shared slot all get the same scale
        weights = weights * scale

    return weights.to(device=dev).contiguous(), ids.to(device=dev).contiguous()


_HASH_TOPK_SCHEMA = (
    "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str "
    "scoring_func, int num_fused_shared_experts, int num_experts, float "
    "routed_scaling_factor) -> (Tensor, Tensor)"
)


def hash_topk_cpu(
    gating_output,
    tid2eid,
    topk,
    scoring_func,
    num_fused_shared_experts,
    num_experts,
    routed_scaling_factor,
):
    _check(gating_output.is_contiguous(), "gating_output must be contiguous")
    _check(tid2eid.is_contiguous(), "tid2eid must be contiguous")
    num_tokens = gating_output.shape[0]
    num_experts_gating = gating_output.shape[1]
    topk = int(topk)
    nfse = int(num_fused_shared_experts)
    num_experts = int(num_experts)
    routed_topk = topk - nfse
    _check(tid2eid.shape[0] == num_tokens, "tid2eid row count must match num_tokens")
    _check(tid2eid.shape[1] == routed_topk, "tid2eid column count must match routed_topk")
    _check(tid2eid.dtype == torch.int32, "tid2eid must be int32")
    _check(num_experts_gating == num_experts, "num_experts mismatch")
    scores_fn = _score_fn(scoring_func, ("softmax", "sigmoid", "sqrtsoftplus"))
    _check(
        gating_output.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"Unsupported dtype for hash_topk_cpu: {gating_output.dtype}",
    )
    _check_routing_shape(_HASH_TOPK_SHAPES, "hash_topk_cpu", num_experts, routed_topk)
    rsf = float(torch.tensor(float(routed_scaling_factor), dtype=torch.float32).item())

    dev = gating_output.device
    weights = torch.zeros((num_tokens, topk), dtype=torch.float32, device=dev)
    ids = torch.zeros((num_tokens, topk), dtype=torch.int32, device=dev)

    scores = scores_fn(gating_output.to(torch.float32))  # [T, E]
    eid = tid2eid.to(torch.int64)
    # The kernel reads scores[eid] unchecked; refuse out-of-range ids instead
    # of reading garbage.
    if eid.numel() > 0:
        _check(
            bool(((eid >= 0) & (eid < num_experts)).all()),
            "hash_topk_cpu: tid2eid holds an expert id outside [0, num_experts)",
        )
    w = scores.gather(1, eid)  # [T, routed_topk]
    if scoring_func != "softmax":  # renormalise for non-softmax scoring
        s = w.sum(dim=-1, keepdim=True)
        scale = 1.0 / s
        if nfse == 0:
            scale = scale * rsf
        w = torch.where(s > 0.0, w * scale, w)
    weights[:, :routed_topk] = w
    ids[:, :routed_topk] = tid2eid
    if nfse > 0:
        # NB: for nfse > 1 the kernel leaves slots [routed_topk, topk-1)
        # uninitialised (at::empty); we leave them 0.
        ids[:, topk - 1] = _lcg_shared_ids(num_tokens, nfse, num_experts, dev)
        weights[:, topk - 1] = w.sum(dim=-1) / rsf
    return weights, ids


OPS = {
    "hc_pre_fused_cpu": (_HC_PRE_SCHEMA, hc_pre_fused_cpu),
    "hc_post_fused_cpu": (_HC_POST_SCHEMA, hc_post_fused_cpu),
    "hc_head_fused_cpu": (_HC_HEAD_SCHEMA, hc_head_fused_cpu),
    "biased_topk_cpu": (_BIASED_TOPK_SCHEMA, biased_topk_cpu),
    "hash_topk_cpu": (_HASH_TOPK_SCHEMA, hash_topk_cpu),
}


# ---------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------



def self_check() -> None:
    """Compares every op of ``OPS`` with an independent eager reference (lab only).

    Pure: runs under ``torch.random.fork_rng`` with its own seed (the caller's RNG state is
    restored), registers nothing and leaves torch's thread settings alone. Raises
    AssertionError naming every failed check; on success prints one summary line."""
    _selfcheck.run("mhc_router", _run_checks)


def _run_checks() -> list[tuple[str, bool, str]]:
    """The checks of ``self_check``: [(name, ok, detail)]."""
    import math

    results: list[tuple[str, bool, str]] = []

    def check(name: str, cond: bool, detail: str = "") -> None:
        results.append((name, bool(cond), detail))

    def close(a, b, atol, rtol):
        return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)

    # ---- references: vLLM's eager mhc_pre_torch / mhc_post_torch (copied) ----
    def ref_mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, pre_eps, sk_eps, post_mult, repeat):
        hc_mult, hidden = residual.shape[-2:]
        rf = residual.view(-1, hc_mult, hidden)
        n = rf.shape[0]
        xx = rf.view(n, hc_mult * hidden).float()
        mixes = xx @ fn.t()
        mixes = mixes * torch.rsqrt(xx.square().sum(-1, keepdim=True) / (hc_mult * hidden)
                                    + rms_eps)
        pre = torch.sigmoid(mixes[:, :hc_mult] * hc_scale[0] + hc_base[:hc_mult]) + pre_eps
        post = torch.sigmoid(mixes[:, hc_mult:2 * hc_mult] * hc_scale[1]
                             + hc_base[hc_mult:2 * hc_mult]) * post_mult
        cl = (mixes[:, 2 * hc_mult:].view(n, hc_mult, hc_mult) * hc_scale[2]
              + hc_base[2 * hc_mult:].view(1, hc_mult, hc_mult))
        cm = torch.softmax(cl, -1) + sk_eps
        cm = cm / (cm.sum(-2, keepdim=True) + sk_eps)
        for _ in range(repeat - 1):
            cm = cm / (cm.sum(-1, keepdim=True) + sk_eps)
            cm = cm / (cm.sum(-2, keepdim=True) + sk_eps)
        li = (pre.unsqueeze(-1) * rf.float()).sum(1).to(torch.bfloat16)
        return post, cm, li

    def ref_mhc_post(x, residual, post, comb):
        mixed = torch.einsum("...ij,...ih->...jh", comb.float(), residual.float())
        # post [..., hc, 1]
        return (mixed + post.float() * x.unsqueeze(-2).float()).to(residual.dtype)

    def ref_hc_head(residual, fn, hc_scale, hc_base, rms_eps, hc_eps):
        hc_mult, hidden = residual.shape[-2:]
        rf = residual.view(-1, hc_mult, hidden)
        xx = rf.reshape(rf.shape[0], -1).float()
        mixes = (xx @ fn.t()) * torch.rsqrt(xx.square().sum(-1, keepdim=True)
                                            / (hc_mult * hidden) + rms_eps)
        pre = torch.sigmoid(mixes * hc_scale[0] + hc_base.view(1, hc_mult)) + hc_eps
        return (pre.unsqueeze(-1) * rf.float()).sum(1).to(torch.bfloat16)

    # ---- mHC pre (as kernels/mhc/cpu.py calls it) ----
    for T, hidden, iters in [(1, 64, 20), (5, 96, 20), (300, 40, 3), (3, 32, 1)]:
        hc = 4
        mix_hc = (2 + hc) * hc
        residual = torch.randn(T, hc, hidden, dtype=torch.bfloat16)
        fn = torch.randn(mix_hc, hc * hidden) * 0.05
        hc_scale = torch.randn(3) * 0.5
        hc_base = torch.randn(mix_hc) * 0.5
        y, post, comb = hc_pre_fused_cpu(residual, fn, hc_scale, hc_base, hc, iters, 1e-6, 1e-6)
        rp, rc, ry = ref_mhc_pre(residual, fn, hc_scale, hc_base, 1e-6, 1e-6, 1e-6, 2.0, iters)
        check(f"hc_pre shapes/dtypes T={T}",
              y.shape == (T, hidden) and y.dtype == torch.bfloat16
              and post.shape == (T, hc) and post.dtype == torch.float32
              and comb.shape == (T, hc, hc) and comb.dtype == torch.float32)
        check(f"hc_pre post T={T}", close(post, rp, 1e-5, 1e-5))
        check(f"hc_pre comb T={T}", close(comb, rc, 1e-5, 1e-5))
        check(f"hc_pre y T={T}", close(y, ry, 2e-2, 1e-2))
    # comb is ~doubly stochastic after many iterations
    check("hc_pre comb col sums ~1", close(comb.sum(-2), torch.ones(3, 4), 1e-3, 0))

    # hc_mult = 2 path (kernel supports hc_mult >= 2)
    residual = torch.randn(4, 2, 48, dtype=torch.float16)
    fn = torch.randn(8, 96) * 0.05
    hs, hb = torch.randn(3), torch.randn(8)
    y, post, comb = hc_pre_fused_cpu(residual, fn, hs, hb, 2, 5, 1e-6, 1e-3)
    rp, rc, ry = ref_mhc_pre(residual, fn, hs, hb, 1e-6, 1e-3, 1e-3, 2.0, 5)
    check("hc_pre hc=2 fp16", close(post, rp, 1e-5, 1e-5) and close(comb, rc, 1e-5, 1e-5)
          and close(y, ry.to(torch.float16), 2e-2, 1e-2) and y.dtype == torch.float16)

    try:
        hc_pre_fused_cpu(residual.float(), fn, hs, hb, 2, 5, 1e-6, 1e-3)
        check("hc_pre rejects fp32 x", False)
    except RuntimeError:
        check("hc_pre rejects fp32 x", True)

    # ---- mHC post (as mhc_post_cpu calls it) ----
    for T, hidden in [(1, 64), (7, 100), (300, 33)]:
        hc = 4
        x = torch.randn(T, hidden, dtype=torch.bfloat16)
        residual = torch.randn(T, hc, hidden, dtype=torch.bfloat16)
        post = torch.randn(T, hc, 1)
        comb = torch.randn(T, hc, hc)
        out = hc_post_fused_cpu(x, residual, post.reshape(-1, hc).float(),
                                comb.reshape(-1, hc, hc).float())
        ref = ref_mhc_post(x, residual, post, comb)
        check(f"hc_post T={T}", out.shape == (T, hc, hidden) and out.dtype == torch.bfloat16
              and close(out, ref, 3e-2, 1e-2))

    # ---- hc head (hc_head_fused_cpu wrapper passes (hc_eps, rms_norm_eps)) ----
    for T, hidden in [(1, 64), (9, 80), (300, 24)]:
        hc = 4
        residual = torch.randn(T, hc, hidden, dtype=torch.bfloat16)
        fn = torch.randn(hc, hc * hidden) * 0.05
        hs = torch.randn(1) * 0.5
        hb = torch.randn(hc) * 0.5
        rms_eps, hc_eps = 1e-6, 1e-3
        out = hc_head_fused_cpu(residual, fn, hs, hb, hc_eps, rms_eps)
        ref = ref_hc_head(residual, fn, hs, hb, rms_eps, hc_eps)
        check(f"hc_head T={T}", out.shape == (T, hidden) and out.dtype == torch.bfloat16
              and close(out, ref, 2e-2, 1e-2))
    # eps order matters: a large hc_eps must shift the gates (not the RMS)
    out_a = hc_head_fused_cpu(residual, fn, hs, hb, 0.5, 1e-6)
    ref_a = ref_hc_head(residual, fn, hs, hb, 1e-6, 0.5)
    check("hc_head eps order", close(out_a, ref_a, 2e-2, 1e-2))

    # ---- routing: independent per-token loop references mirroring topk.cpp ----
    M64 = (1 << 64) - 1

    def py_shared_ids(n_tokens, nfse, base):
        st = (0 * _LCG_A + _LCG_C) & M64
        out = []
        for _ in range(n_tokens):
            st = (st * _LCG_A + _LCG_C) & M64
            out.append(base + (st >> 33) % nfse)
        return out

    def py_score(v, func):
        if func == "sigmoid":
            return 1.0 / (1.0 + math.exp(-v))
        if v > 20.0:
            return math.sqrt(v)
        if v < -15.0:
            return math.exp(v / 2)
        return math.sqrt(math.log1p(math.exp(v)))

    def ref_biased(gating, bias, topk, renorm, func, nfse, rsf, apply):
        g = gating.float().tolist()
        b = bias.float().tolist()
        rsf_v = rsf if rsf is not None else 0.0
        sh = py_shared_ids(len(g), nfse, len(b)) if nfse else None
        W, I = [], []
        for i, row in enumerate(g):
            sc = [py_score(v, func) for v in row]
            order = sorted(range(len(sc)), key=lambda e: -(sc[e] + b[e]))
            ids = order[:topk]
            w = [sc[e] for e in ids]
            if nfse:
                ids[-1] = sh[i]
                if rsf_v != 0.0:
                    w[-1] = sum(w[:-1]) / rsf_v
            if renorm:
                ne = topk if nfse == 0 else topk - 1
                s = 1.0 / sum(w[:ne])
                if apply:
                    s *= rsf_v
                w = [v * s for v in w]
            W.append(w)
            I.append(ids)
        return torch.tensor(W, dtype=torch.float32), torch.tensor(I, dtype=torch.int32)

    def ref_hash(gating, t2e, topk, func, nfse, ne, rsf):
        g = gating.float().tolist()
        rt = topk - nfse
        sh = py_shared_ids(len(g), nfse, ne) if nfse else None
        W, I = [], []
        for i, row in enumerate(g):
            if func == "softmax":
                m = max(row)
                ex = [math.exp(v - m) for v in row]
                sc = [v / sum(ex) for v in ex]
            else:
                sc = [py_score(v, func) for v in row]
            ids = [int(e) for e in t2e[i].tolist()]
            w = [sc[e] for e in ids]
            if func != "softmax":
                s = sum(w)
                if s > 0:
                    k = 1.0 / s * (rsf if nfse == 0 else 1.0)
                    w = [v * k for v in w]
            ids = ids + [0] * (topk - rt)
            w = w + [0.0] * (topk - rt)
            if nfse:
                ids[-1] = sh[i]
                w[-1] = sum(w[:rt]) / rsf
            W.append(w)
            I.append(ids)
        return torch.tensor(W, dtype=torch.float32), torch.tensor(I, dtype=torch.int32)

    # cpu_router call shape: biased_topk_cpu(g, g, bias, k, True, "sqrtsoftplus", 0, rsf, True)
    for T, E, k, dt in [(1, 256, 6, torch.bfloat16), (37, 64, 8, torch.float32),
                        (5, 128, 6, torch.float16)]:
        g = (torch.randn(T, E) * 4).to(dt)
        g[0, :3] = torch.tensor([30.0, -20.0, 0.0]).to(dt)  # hit both sqrtsoftplus branches
        bias = torch.randn(E) * 0.1
        w, ids = biased_topk_cpu(g, g, bias, k, True, "sqrtsoftplus", 0, 1.5, True)
        rw, ri = ref_biased(g, bias, k, True, "sqrtsoftplus", 0, 1.5, True)
        check(f"biased_topk sqrtsoftplus T={T} E={E} {dt}",
              w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, k)
              and torch.equal(ids, ri) and close(w, rw, 1e-5, 1e-5)
              and close(w.sum(-1), torch.full((T,), 1.5), 1e-5, 1e-5))
    # selection is biased, weights unbiased
    g = torch.zeros(2, 64)
    bias = torch.zeros(64)
    bias[10] = 1.0
    g[:, 3] = 2.0
    w, ids = biased_topk_cpu(g, g, bias, 6, False, "sigmoid", 0, None, False)
    check("biased_topk bias steers selection only",
          int(ids[0, 0]) == 10 and int(ids[0, 1]) == 3
          and abs(float(w[0, 0]) - 0.5) < 1e-6
          and abs(float(w[0, 1]) - 1 / (1 + math.exp(-2))) < 1e-6)
    # sigmoid, no renorm, with fused shared experts, rsf None and set
    for nfse, rsf, renorm, apply in [(1, 2.5, True, True), (2, None, True, False),
                                     (1, 2.0, False, False)]:
        T, E, k = 40, 64, 7
        g = torch.randn(T, E) * 3
        bias = torch.randn(E) * 0.1
        w, ids = biased_topk_cpu(g, g, bias, k, renorm, "sigmoid", nfse, rsf, apply)
        rw, ri = ref_biased(g, bias, k, renorm, "sigmoid", nfse, rsf, apply)
        check(f"biased_topk sigmoid shared nfse={nfse} rsf={rsf} renorm={renorm}",
              torch.equal(ids, ri) and close(w, rw, 1e-5, 1e-5))

    # hash_topk as cpu_router calls it: tid2eid = table[input_ids]
    for T, E, k, dt in [(1, 256, 6, torch.bfloat16), (33, 64, 7, torch.float32),
                        (4, 128, 8, torch.float16)]:
        vocab = 50
        table = torch.stack([torch.randperm(E)[:k] for _ in range(vocab)]).to(torch.int32)
        input_ids = torch.randint(0, vocab, (T,))
        t2e = table[input_ids]
        g = (torch.randn(T, E) * 4).to(dt)
        w, ids = hash_topk_cpu(g, t2e, k, "sqrtsoftplus", 0, E, 1.5)
        rw, ri = ref_hash(g, t2e, k, "sqrtsoftplus", 0, E, 1.5)
        check(f"hash_topk sqrtsoftplus T={T} E={E} k={k} {dt}",
              w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (T, k)
              and torch.equal(ids, ri) and close(w, rw, 1e-5, 1e-5)
              and close(w.sum(-1), torch.full((T,), 1.5), 1e-5, 1e-5))
    for func, nfse in [("softmax", 0), ("sigmoid", 0), ("softmax", 1), ("sigmoid", 1),
                       ("sqrtsoftplus", 2)]:
        T, E, k = 21, 64, 8
        t2e = torch.stack([torch.randperm(E)[: k - nfse] for _ in range(T)]).to(torch.int32)
        g = torch.randn(T, E) * 3
        w, ids = hash_topk_cpu(g, t2e, k, func, nfse, E, 2.5)
        rw, ri = ref_hash(g, t2e, k, func, nfse, E, 2.5)
        check(f"hash_topk {func} nfse={nfse}", torch.equal(ids, ri) and close(w, rw, 1e-5, 1e-5))
    try:
        bad = torch.full((2, 6), 64, dtype=torch.int32)
        hash_topk_cpu(torch.randn(2, 64), bad, 6, "sqrtsoftplus", 0, 64, 1.0)
        check("hash_topk rejects out-of-range eid", False)
    except RuntimeError:
        check("hash_topk rejects out-of-range eid", True)

    # LCG jump-ahead vs python big-int reference over many tokens
    check("shared-expert LCG ids (5000 tokens)",
          _lcg_shared_ids(5000, 3, 256, "cpu").tolist() == py_shared_ids(5000, 3, 256))

    # schema strings parse
    try:
        from torch._C import parse_schema
        for name, (schema, _) in OPS.items():
            parse_schema("_C::" + schema)
        check("schemas parse", True)
    except Exception as e:  # pragma: no cover
        check("schemas parse", False, repr(e))
    return results


if __name__ == "__main__":
    self_check()
