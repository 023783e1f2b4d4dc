"""The forward's resolve / stage / write translation (``kernels/resolve_kernels.py``, Triton, run
by Triton's interpreter on CPU) against their torch references (``kernels/resolve_reference.py``)
and against brute force, by semantics: the bytes each (token, k) reads from
``[staging | device pool]`` after resolve + stage, the set of logged misses (and their host
slots), the labels touched, the counts. Staging row numbers are not compared (the Triton kernel
takes them by atomic counter). Cases: duplicates, -1 padding, padded batch rows
(``num_tokens``), the identity flag, staging overflow, stamps across calls, byte rows of 1152
(bf16) and 656 (fp8_ds_mla) B, and a real ``TieredMapping`` settled from the miss log."""

import importlib

import pytest
import torch

from _triton_interpreter import interpreted
from ulacache_vllm import kernels
from ulacache_vllm.kernels import resolve_reference as ref

# Triton reads TRITON_INTERPRET when it is first imported, when @triton.jit decorates the
# kernels and while they run: set for these imports here and for this module's tests by the
# fixture, never left in the environment (_triton_interpreter.py).
with interpreted():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    tk = importlib.import_module("ulacache_vllm.kernels.resolve_kernels")

pytestmark = pytest.mark.usefixtures("triton_interpreter")

BF16_ROW, FP8_ROW = 1152, 656
UNTRACKED = torch.iinfo(torch.int16).max


class World:
    """N logical addresses, each unmapped, on the device (D slots) or on the host (H slots),
    with random bytes; ``buf`` is ``[staging S | device pool D]`` (dev_base = S + pad)."""

    def __init__(self, seed, N=300, D=120, H=200, S=64, row_bytes=FP8_ROW, pad=3,
                 p_dev=0.4, p_host=0.45):
        g = self.g = torch.Generator().manual_seed(seed)
        self.N, self.D, self.H, self.S, self.rb = N, D, H, S, row_bytes
        self.dev_base = S + pad
        self.truth = torch.randint(0, 256, (N, row_bytes), generator=g, dtype=torch.uint8)
        u = torch.rand(N, generator=g)
        tier = torch.where(u < p_dev, 0, torch.where(u < p_dev + p_host, 1, -1))
        # Distinct slots per tier (as many as fit), the rest unmapped.
        dev_addr = tier.eq(0).nonzero().squeeze(1)[:D]
        host_addr = tier.eq(1).nonzero().squeeze(1)[:H]
        self.table = torch.full((N,), -1, dtype=torch.int64)
        self.dev_slot = torch.randperm(D, generator=g)[:dev_addr.numel()]
        self.host_slot = torch.randperm(H, generator=g)[:host_addr.numel()]
        self.table[dev_addr] = self.dev_slot
        self.table[host_addr] = (1 << 32) | self.host_slot
        self.buf = torch.randint(0, 256, (self.dev_base + D, row_bytes), generator=g,
                                 dtype=torch.uint8)
        self.buf[self.dev_base + self.dev_slot] = self.truth[dev_addr]
        self.host = torch.randint(0, 256, (H, row_bytes), generator=g, dtype=torch.uint8)
        self.host[self.host_slot] = self.truth[host_addr]
        self.labels = torch.randint(0, 50, (D + 1,), generator=g, dtype=torch.int64).to(torch.int16)
        self.labels[D] = UNTRACKED

    def selection(self, T, K, *, p_pad=0.2, dup_pool=None):
        """[T, K] logical slots drawn from ``dup_pool`` addresses (duplicates), -1 padded."""
        g = self.g
        pool = torch.randperm(self.N, generator=g)[:dup_pool or self.N]
        sel = pool[torch.randint(0, pool.numel(), (T, K), generator=g)]
        return torch.where(torch.rand(T, K, generator=g) < p_pad, -1, sel)

    def run(self, mod, logical, *, ntok=None, ident=0, rnd=77, state=None, touch=True,
            S=None):
        """resolve + stage with ``mod`` on copies of the world's buffers; returns
        ``(rows, bytes read per (t, k) or None, log, labels, buf)``."""
        S = self.S if S is None else S
        state = state or ref.ResolveState(self.N, S, "cpu", for_triton=mod is tk)
        labels = self.labels.clone() if touch else None
        buf = self.buf.clone()
        rows = mod.resolve(logical, self.table, labels, torch.tensor([rnd]),
                           None if ntok is None else torch.tensor([ntok], dtype=torch.int32),
                           torch.tensor([ident], dtype=torch.int32), state,
                           dev_base=self.dev_base)
        mod.stage(self.host, buf[:S], state.log)
        return rows, buf, state.log, labels

    def expect(self, logical, ntok, ident):
        """Brute force: per (t, k) the address whose bytes it reads (or -1 for no row); the
        distinct misses; the touched slots; unmapped count."""
        T, K = logical.shape
        src = torch.full((T, K), -1, dtype=torch.int64)
        misses, touched, unmapped = set(), set(), 0
        for t in range(T):
            for k in range(K):
                a = int(logical[t, k])
                if a < 0 or (ntok is not None and t >= ntok):
                    continue
                if ident:
                    src[t, k] = a
                    continue
                v = int(self.table[a])
                if v < 0:
                    unmapped += 1
                    continue
                src[t, k] = a
                if v >> 32 == 0:
                    touched.add(v & 0xFFFFFFFF)
                else:
                    misses.add(a)
        return src, misses, touched, unmapped


def _check(w, mod, logical, *, ntok=None, ident=0, S=None, rnd=77):
    S = w.S if S is None else S
    rows, buf, log, labels = w.run(mod, logical, ntok=ntok, ident=ident, S=S, rnd=rnd)
    src, misses, touched, unmapped = w.expect(logical, ntok, ident)
    assert rows.dtype == torch.int32 and rows.shape == logical.shape
    claimed, n_unm = log.counts.tolist()
    assert claimed == len(misses) and n_unm == unmapped
    n = min(claimed, S)
    addr, host = log.addr[:n], log.host[:n]
    # The logged misses: distinct, among the expected ones (all of them without overflow),
    # each with its host slot.
    assert len(set(addr.tolist())) == n and set(addr.tolist()) <= misses
    if claimed <= S:
        assert set(addr.tolist()) == misses
    assert torch.equal(host, w.table[addr] & 0xFFFFFFFF)
    logged = set(addr.tolist())
    flat_rows = rows.reshape(-1).long()
    # Bytes per (t, k): what the row holds after stage is the address's bytes; -1 where
    # nothing is read (or the miss overflowed staging). Identity reads the device pool at the
    # logical slot itself.
    for i, (r, a) in enumerate(zip(flat_rows.tolist(), src.reshape(-1).tolist())):
        if a < 0 or (not ident and int(w.table[a]) >> 32 == 1 and a not in logged):
            assert r == -1, (i, r, a)
            continue
        if ident:
            assert r == w.dev_base + a
            continue
        want = w.truth[a]
        assert r >= 0 and torch.equal(buf[r], want), (i, r, a)
        if int(w.table[a]) >> 32 == 1:
            assert r < S
        else:
            assert r >= w.dev_base
    # Dedup: one staging row per missed address.
    st = {}
    for r, a in zip(flat_rows.tolist(), src.reshape(-1).tolist()):
        if 0 <= r < S:
            assert st.setdefault(a, r) == r
    assert len(set(st.values())) == len(st) == n
    # Labels: hits (of valid tokens, not under identity) get the round; nothing else changes.
    want_lab = w.labels.clone()
    if touched:
        want_lab[torch.tensor(sorted(touched))] = rnd
    assert torch.equal(labels[:w.D], want_lab[:w.D])
    return rows, buf, log


def _gathered(rows, buf):
    r = rows.reshape(-1).long()
    return torch.where((r >= 0).unsqueeze(1), buf[r.clamp(min=0)], 0)


def test_kernels_really_interpreted():
    for f in (tk._resolve_kernel, tk._resolve_fixup_kernel, tk._stage_kernel,
              tk._write_translate_kernel):
        assert isinstance(f, InterpretedFunction), "Triton kernels would not run on CPU"


def test_dispatch(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.delenv("ULACACHE_FORCE_TRITON", raising=False)
    assert kernels.resolve_impl(x) is ref
    monkeypatch.setenv("ULACACHE_FORCE_TRITON", "1")
    assert kernels.resolve_impl(x) is tk
    from ulacache_vllm.core import mapping

    assert (ref.TIER_DEVICE, ref.TIER_HOST) == (mapping.DEVICE, mapping.HOST)
    assert kernels.host_view(x, "cpu") is x


@pytest.mark.parametrize("row_bytes", [BF16_ROW, FP8_ROW])
@pytest.mark.parametrize("case", ["dups", "padded_batch", "identity", "overflow", "no_pad",
                                  "multi_block"])
def test_resolve_stage_semantics(row_bytes, case, monkeypatch):
    """Triton and reference each give brute force's bytes per (t, k), misses, labels and
    counts; and the same bytes as each other. ``multi_block``: 8 programs share the staging
    counter and the claim table (blocks of 32)."""
    if case == "multi_block":
        monkeypatch.setattr(tk, "_BLOCK", 32)
    seed = {BF16_ROW: 1, FP8_ROW: 2}[row_bytes] * 100 + len(case)
    w = World(seed, row_bytes=row_bytes, S=8 if case == "overflow" else 64)
    T, K = 6, 40
    logical = w.selection(T, K, dup_pool=60 if case != "no_pad" else None,
                          p_pad=0.0 if case == "no_pad" else 0.2)
    ntok = {"padded_batch": 4, "identity": 5}.get(case)
    ident = int(case == "identity")
    if ident:  # identity placement: logical slots inside the device pool
        logical = torch.where(logical >= 0, logical % w.D, -1)
    if case == "no_pad":  # (the stock converter's int32 indices)
        logical = logical.to(torch.int32)
    outs = [_check(w, mod, logical, ntok=ntok, ident=ident) for mod in (ref, tk)]
    (r0, b0, l0), (r1, b1, l1) = outs
    assert torch.equal(_gathered(r0, b0), _gathered(r1, b1))
    assert torch.equal(r0 < 0, r1 < 0)
    assert torch.equal(l0.counts, l1.counts)
    if case == "overflow":
        assert int(l0.counts[0]) > w.S  # the case really overflows
    if case == "padded_batch":  # padded rows hold addresses that are read nowhere else
        assert (r1[ntok:] == -1).all()


def test_padded_rows_touch_and_log_nothing():
    """Addresses only in padded batch rows are neither touched nor logged."""
    w = World(5)
    dev = (w.table >= 0) & (w.table >> 32 == 0)
    host = w.table >> 32 == 1
    a_dev = dev.nonzero().squeeze(1)[:10]
    a_host = host.nonzero().squeeze(1)[:10]
    logical = torch.full((3, 20), -1, dtype=torch.int64)
    logical[0, :5] = a_dev[:5]
    logical[0, 5:10] = a_host[:5]
    logical[2, :10] = a_dev           # padded row: only a_dev[5:] are new here
    logical[2, 10:20] = a_host
    for mod in (ref, tk):
        rows, _, log, labels = w.run(mod, logical, ntok=2)
        assert (rows[2] == -1).all()
        assert int(log.counts[0]) == 5 and set(log.addr[:5].tolist()) == set(a_host[:5].tolist())
        assert torch.equal(labels[w.table[a_dev[5:]]], w.labels[w.table[a_dev[5:]]])
        assert (labels[w.table[a_dev[:5]]] == 77).all()


def test_no_labels_and_all_tokens_default():
    """``labels=None`` touches nothing; ``num_tokens``/``identity`` None: every row valid,
    no fast path."""
    w = World(9)
    logical = w.selection(4, 16, dup_pool=30)
    outs = []
    for mod in (ref, tk):
        st = ref.ResolveState(w.N, w.S, "cpu", for_triton=mod is tk)
        buf = w.buf.clone()
        rows = mod.resolve(logical, w.table, None, None, None, None, st, dev_base=w.dev_base)
        mod.stage(w.host, buf[:w.S], st.log)
        outs.append(_gathered(rows, buf))
    assert torch.equal(*outs)
    with pytest.raises(ValueError, match="round"):
        ref.resolve(logical, w.table, w.labels.clone(), None, None, None, st, dev_base=w.dev_base)
    with pytest.raises(ValueError, match="dev_base"):
        ref.resolve(logical, w.table, None, None, None, None, st, dev_base=w.S - 1)


def test_stamps_across_calls():
    """One state over several calls (layers, steps): each call dedups on its own (a claim of
    an earlier call is not this call's), its log starts empty, and a smaller call after a
    bigger one leaves no stale rows."""
    w = World(11, S=64)
    st_t = ref.ResolveState(w.N, w.S, "cpu", for_triton=True)
    st_r = ref.ResolveState(w.N, w.S, "cpu", for_triton=False)
    for i, (T, K, pool) in enumerate([(4, 30, 40), (4, 30, 40), (2, 8, 10), (5, 30, 200)]):
        logical = w.selection(T, K, dup_pool=pool)
        _, misses, _, _ = w.expect(logical, None, 0)
        got = []
        for mod, st in ((ref, st_r), (tk, st_t)):
            rows, buf, log, _ = w.run(mod, logical, state=st)
            got.append(_gathered(rows, buf))
            n = min(int(log.counts[0]), w.S)
            assert int(log.counts[0]) == len(misses)
            assert set(log.addr[:n].tolist()) <= misses
        assert torch.equal(*got), i
    assert int(st_t.stamp) == int(st_r.stamp) == 4


@pytest.mark.parametrize("row_bytes", [BF16_ROW, FP8_ROW, 18, 7])
def test_stage_bytes_verbatim(row_bytes):
    """Stage copies exactly the logged rows (words of 8/4/2/1 bytes as the size allows),
    leaves the others, and reads the count from the device log."""
    g = torch.Generator().manual_seed(row_bytes)
    H, S = 50, 12
    host = torch.randint(0, 256, (H, row_bytes), generator=g, dtype=torch.uint8)
    log = ref.MissLog(S, "cpu")
    idx = torch.randperm(H, generator=g)[:S]
    log.host.copy_(idx)
    for n in (0, 5, S, S + 3):  # S + 3: an overflowed count copies S rows
        log.counts[0] = n
        outs = []
        for mod in (ref, tk):
            staging = torch.randint(0, 256, (S + 2, row_bytes), generator=g, dtype=torch.uint8)
            keep = staging.clone()
            mod.stage(host, staging, log)
            m = min(n, S)
            assert torch.equal(staging[:m], host[idx[:m]])
            assert torch.equal(staging[m:], keep[m:])
            outs.append(staging[:m])
        assert torch.equal(*outs)
    with pytest.raises(ValueError, match="host_view"):
        ref.stage(host.to("meta"), torch.empty(S, row_bytes, dtype=torch.uint8), log)


def test_write_translate():
    w = World(13)
    on_dev = ((w.table >= 0) & (w.table >> 32 == 0)).nonzero().squeeze(1)
    on_host = (w.table >> 32 == 1).nonzero().squeeze(1)
    slots = torch.cat([on_dev[:20], torch.tensor([-1, -1]), on_host[:3], on_dev[20:25]])
    trash = w.dev_base + w.D - 1
    want = torch.where(slots >= 0, w.dev_base + w.table[slots.clamp(min=0)], trash)
    want[22:25] = trash  # host entries: a contract breach, trashed and counted
    for mod in (ref, tk):
        err = torch.zeros(1, dtype=torch.int64)
        rows = mod.write_translate(slots, w.table, torch.tensor([0]), dev_base=w.dev_base,
                                   trash_row=trash, errors=err)
        assert rows.dtype == torch.int64 and torch.equal(rows, want) and int(err) == 3
        ident = mod.write_translate(slots.view(2, -1), w.table, torch.tensor([1]),
                                    dev_base=w.dev_base, trash_row=trash)
        assert torch.equal(ident.view(-1), torch.where(slots >= 0, w.dev_base + slots, trash))
        out = torch.empty_like(slots)
        assert mod.write_translate(slots, w.table, None, dev_base=0, trash_row=-5,
                                   out=out) is out


def test_settle_through_tiered_mapping():
    """A real mapping under pressure: resolve through its committed table and PB-LRU labels
    (rows agree with ``locate``), settle the logged misses outside (``ensure_resident`` +
    ``apply`` with byte-row copies), and the same selection then resolves to device hits only,
    reading the same bytes."""
    from ulacache_vllm.core import TieredMapping
    from ulacache_vllm.core.pblru import PBLRU

    N, D, H, S, rb = 200, 64, 200, 48, FP8_ROW
    g = torch.Generator().manual_seed(3)
    truth = torch.randint(0, 256, (N, rb), generator=g, dtype=torch.uint8)
    logical = torch.randint(0, 160, (3, 16), generator=g)
    logical[1, 3:6] = -1
    outs = []
    for mod in (ref, tk):
        m = TieredMapping(N, D, H, lru=lambda n, d, r: PBLRU(n, d, r), ring_size=3)
        dev_base = S
        buf = torch.zeros(S + D, rb, dtype=torch.uint8)
        host = torch.zeros(H, rb, dtype=torch.uint8)
        pools = {0: buf[dev_base:], 1: host, 4: buf[:S]}  # DEVICE, HOST, STAGING

        def copy(st, src, dt, dst):
            pools[dt][dst] = pools[st][src]

        for lo in range(0, 160, 40):  # write 160 addresses, 40 a round: 96 demoted
            slots, plan = m.assign(torch.arange(lo, lo + 40))
            plan.apply(copy)
            buf[dev_base + slots] = truth[lo:lo + 40]
            m.advance_round()
        assert m.host_used > 0
        state = ref.ResolveState(N, S, "cpu", for_triton=mod is tk)
        rnd = torch.tensor([m.policy.round])
        rows = mod.resolve(logical, m.visible, m.policy.labels, rnd, None, None, state,
                           dev_base=dev_base)
        dslot, hslot = m.locate(logical)
        assert torch.equal(rows.long() >= dev_base, dslot >= 0)
        assert torch.equal(rows[dslot >= 0].long(), dev_base + dslot[dslot >= 0])
        mod.stage(host, buf[:S], state.log)
        valid = logical >= 0
        assert torch.equal(buf[rows[valid].long()], truth[logical[valid]])
        addr, hs, overflow, unmapped = state.log.take()
        assert overflow == unmapped == 0
        assert set(addr.tolist()) == set(logical[hslot >= 0].tolist())
        assert torch.equal(hs, m.locate(addr)[1])
        # Settle outside the forward (in address order: the log's order is the kernel's).
        m.advance_round()
        _, plan = m.ensure_resident(addr.sort().values)
        plan.apply(copy)
        rnd = torch.tensor([m.policy.round])
        rows2 = mod.resolve(logical, m.visible, m.policy.labels, rnd, None, None, state,
                            dev_base=dev_base)
        assert int(state.log.counts[0]) == 0
        assert (rows2[valid] >= dev_base).all()
        assert torch.equal(buf[rows2[valid].long()], truth[logical[valid]])
        outs.append(m.policy.labels.clone())
    assert torch.equal(outs[0][:D], outs[1][:D])  # same touches, same promotions
