"""DeepSeek-V4's compressor states under the v4 line: a prefill chunk's out-of-window states
are step scratch, not arena pages.

V4's compressors keep an fp32 state per token (C4: 8 KiB main + 2 KiB indexer per layer,
C128: 4 KiB per layer on the real shape) in sliding-window caches of 8 and 128 tokens. vLLM
gives a prefill chunk a state page for every token of the chunk (its CPU kernel writes every
token's state, then compresses each boundary's window out of the cache), and frees all but the
last window once the step is done. So in flight a 3,072-token chunk holds ~24 KiB x 3,072 of
state pages per layer kind that nothing reads after the step: on the tiny 8-layer V4 at
256 MiB that transient, not the decoding requests, bounded the arena (0.50 of the physical
bound, `benchmarks/results/v4_capacity.md`).

Here a chunk's state pages that lie wholly before the last window of the tokens computed
after the step (``main - window + 1``), except those vLLM will hash with prefix caching on (a
cached page must hold its bytes: under stock's retention 0, the window's tail before the
prompt's replay boundary and before a shared-prefix junction, `manager._kept`), are
**transient**: the scheduler hands
vLLM's manager the null block for them (no arena bytes; the admission gate counts a state
kind at one window of pages per request), and the worker runs that step's compressors over a
scratch buffer (`scratch_plan`, `patches/v4_state_scratch`): every token's state is written
to the scratch and, for the kept pages, to the arena; each boundary reads its window from the
scratch (this step's tokens) and from the rows before the step copied in (the tail the arena
kept). Same state values, same kernels: the same compressed rows, bit for bit.

Invariants: transient pages lie before the last window of a step's new pages of a state kind
(positions ascend; kept tails may sit among them) and the pages before the last window of a
step are all transient or freed (cached, if hashed) after it, so vLLM's
window frees (which stop at the first null block going backwards) are replaced by one that
frees every real page below the window from a per-request low-water mark
(`install_window_frees`); a transient page's slots are never written or read (the worker
masks them: they land in the null page's granule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STATE_SUFFIX = "compressor.state_cache"  # vLLM's V4 names its compressor state caches so


def is_state_group(layer_names) -> bool:
    """A KV cache group of V4 compressor states (vLLM's `CompressorStateCache` layers)."""
    return bool(layer_names) and all(n.endswith(STATE_SUFFIX) for n in layer_names)


def transient_states(caching: bool, retention: int | None, eagle: bool) -> bool:
    """Whether a step's out-of-window state pages are transient: always without prefix
    caching; with it, only under vLLM's retention 0 (stock's default: tails kept at the
    replay boundary and a junction only) and without an EAGLE peek."""
    return not caching or (retention == 0 and not eagle)


def hit_tail_pages(window: int, block_size: int) -> int:
    """The contiguous pages a prefix hit reads before its boundary (vLLM's
    ``SlidingWindowManager._contiguous_blocks_for_hit`` without EAGLE): what prefix caching
    keeps of a state kind below the window, per kept boundary."""
    return -(-(window - 1) // block_size)


def window_pages(window: int, block_size: int) -> int:
    """State pages one request holds at most when only the last window is kept: the pages
    a window of ``window - 1`` earlier tokens and the next token can span."""
    return -(-(window - 1) // block_size) + 1


def transient_pages(first_new: int, new: int, main_tokens: int, window: int,
                    block_size: int) -> int:
    """How many of a step's ``new`` state pages (block indices ``first_new ..``) lie wholly
    before ``main_tokens - window + 1``: no token after the step reads them."""
    keep_from = main_tokens - window + 1
    return max(0, min(new, keep_from // block_size - first_new))


def install_window_frees(mgr, low: dict) -> None:
    """Replace a state manager's window frees (`remove_skipped_blocks`) with one that frees
    every real page below the window, skipping the null blocks transient pages left, from the
    request's low-water mark ``low[request_id]`` (amortised: each page visited once); and
    drop the mark when the request is freed."""
    null = mgr._null_block
    bs = mgr.block_size
    free = mgr.free

    def remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None):
        skipped = mgr.get_num_skipped_tokens(processed_computed_tokens)
        blocks = mgr.req_to_blocks.get(request_id)
        if skipped <= 0 or not blocks:
            return
        last = min(skipped // bs, len(blocks))
        lo = low.get(request_id, 0)
        if last <= lo:
            return
        freed = [b for b in reversed(blocks[lo:last]) if not b.is_null]
        blocks[lo:last] = [null] * (last - lo)
        low[request_id] = last
        if freed:
            mgr.block_pool.free_blocks(freed)

    def free_request(request_id):
        low.pop(request_id, None)
        free(request_id)

    mgr.remove_skipped_blocks = remove_skipped_blocks
    mgr.free = free_request


# ---------------------------------------------------------------------------- worker side
SCRATCH_CHUNK_TOKENS = 512  # the step's tokens go through the scratch this many at a time


@dataclass
class ScratchChunk:
    """Tokens ``[start, end)`` of a step through the scratch: the states of tokens ``[lo,
    end)`` (``lo`` = ``start`` less a window, so every in-step row a boundary reads is there)
    at rows ``0 ..`` (``save_rows``), then the tails; ``gather`` ([end - start, window]
    scratch rows each token's window reads, -1 none); ``tail_blocks`` / ``tail_offsets`` /
    ``tail_rows``: arena rows (kept by the previous step) copied into the scratch."""

    start: int
    end: int
    lo: int
    rows: int
    save_rows: torch.Tensor
    gather: torch.Tensor
    tail_blocks: torch.Tensor
    tail_offsets: torch.Tensor
    tail_rows: torch.Tensor


@dataclass
class ScratchPlan:
    """One step's compressor work for one state kind when some of its tokens' pages are
    transient (shared by every layer of the kind): ``keep_slots`` (the step's state slots, -1
    where transient: what the arena gets), the chunks, and ``transient`` (tokens whose state
    is not kept)."""

    keep_slots: torch.Tensor
    chunks: list
    transient: int


def step_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   token_to_req: torch.Tensor) -> torch.Tensor:
    """Each token's position: ``seq_len[r] - (query_end[r] - t)``."""
    t = torch.arange(token_to_req.shape[0], dtype=torch.int64)
    r = token_to_req.long()
    return seq_lens.long()[r] - (query_start_loc.long()[1:][r] - t)


def scratch_plan(slot_mapping: torch.Tensor, block_table: torch.Tensor, block_size: int,
                 token_to_req: torch.Tensor, positions: torch.Tensor, window: int,
                 ratio: int, chunk: int = SCRATCH_CHUNK_TOKENS) -> ScratchPlan | None:
    """The step's `ScratchPlan` for one state kind, or None when no token's page is transient
    (vLLM's own compressor path then runs). A transient page is the null page: its slots lie
    in granule 0, ``[0, block_size)``. Tensor ops over each chunk's tokens (a request's
    tokens are contiguous in the step, positions ascending; no per-token loop). The scratch
    holds at most ``chunk + window - 1`` rows plus one window of tail per request."""
    slot = slot_mapping.long()
    T = slot.shape[0]
    transient = (slot >= 0) & (slot < block_size)
    n_tr = int(transient.sum())
    if n_tr == 0:
        return None
    pos = positions[:T].long()
    req = token_to_req[:T].long()
    R = int(req.max()) + 1
    first = torch.full((R,), 1 << 62, dtype=torch.int64).scatter_reduce_(0, req, pos, "amin")
    W = window
    j = torch.arange(W, dtype=torch.int64)
    back = torch.arange(W - 1, dtype=torch.int64)
    chunks = []
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        lo = max(0, a - (W - 1))
        p, r = pos[a:b], req[a:b]
        fp = first[r]
        q = p.unsqueeze(1) - (W - 1) + j  # [n, W] the window's positions
        in_step = q >= fp.unsqueeze(1)
        row_in = torch.arange(a - lo, b - lo, dtype=torch.int64).unsqueeze(1) - (W - 1) + j
        # Requests whose boundary tokens here read before the step's first token: their
        # tails (the W - 1 rows before it) come from the arena (pages the last step kept).
        reach = ((p + 1) % ratio == 0) & (p - (W - 1) < fp) & (fp > 0)
        needy = torch.zeros(R, dtype=torch.bool)
        needy[r[reach]] = True
        ids = needy.nonzero().squeeze(1)
        n = ids.numel()
        base = torch.full((R,), -1, dtype=torch.int64)
        base[ids] = (b - lo) + torch.arange(n, dtype=torch.int64) * (W - 1)
        tail_row = base[r].unsqueeze(1) + (q - (fp.unsqueeze(1) - (W - 1)))
        gather = torch.where(in_step, row_in, torch.where(
            needy[r].unsqueeze(1), tail_row, torch.full_like(q, -1))).masked_fill_(q < 0, -1)
        local = first[ids].unsqueeze(1) - (W - 1) + back
        valid = local >= 0
        lc = local.clamp(min=0)
        blocks = block_table[ids.unsqueeze(1), lc // block_size].long()
        rows = (b - lo) + torch.arange(n * (W - 1), dtype=torch.int64).view(n, W - 1)
        chunks.append(ScratchChunk(a, b, lo, (b - lo) + n * (W - 1),
                                   torch.arange(b - lo, dtype=torch.int64), gather,
                                   blocks[valid], (lc % block_size)[valid], rows[valid]))
    return ScratchPlan(slot.masked_fill(transient, -1), chunks, n_tr)
