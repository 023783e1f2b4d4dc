"""The torch fallbacks of DeepSeek-V4's five Triton metadata kernels
(``patches/v4_triton_fallbacks.py``) against the Triton bodies themselves, run by Triton's
interpreter on random inputs, bit for bit.

The Triton bodies are vLLM's own source: each kernel's ``def`` is read from the installed vLLM
files (no vLLM import: its CPU build replaces ``triton`` by a placeholder), decorated with the
real ``triton.jit`` in a generated module, and launched with the grid and arguments vLLM's
launchers use. Each test draws batches the metadata builders see: decode and prefill mixes,
padded (zero-length) requests, tokens whose slot is PAD, non-contiguous block tables, query
slices, ``token_offset``, ``replay_start``, the vision variant's visibility, DCP.
"""

import ast
import importlib.util
import inspect
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from _triton_interpreter import interpreted
from ulacache_vllm.patches import v4_triton_fallbacks as fb

# (file under the vllm package, class or None, function) for each kernel, plus the helper the
# token mapping calls.
SOURCES = {
    "token_request": ("v1/attention/ops/metadata.py", None, "_token_request"),
    "token_request_mapping": ("v1/attention/ops/metadata.py", None,
                              "_token_request_mapping_kernel"),
    "compressed_slot_mapping": ("v1/attention/backends/mla/compressor_utils.py",
                                "CompressedSlotMappingKernel", "kernel"),
    "prefill_chunk_metadata": ("v1/attention/backends/mla/indexer.py",
                               "BuildPrefillChunkMetadataKernel", "kernel"),
    "swa_indices_and_lens": ("v1/attention/backends/mla/sparse_swa.py", None,
                             "_compute_swa_indices_and_lens_kernel"),
    "prefill_gather_lens": ("v1/attention/backends/mla/sparse_swa.py",
                            "ComputePrefillMetadataKernel", "kernel"),
}


def _vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _function_source(path: Path, cls: str | None, name: str) -> str:
    src = path.read_text()
    tree = ast.parse(src)
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    return textwrap.dedent(ast.get_source_segment(src, node, padded=True))


def _load_triton_bodies():
    """A module with each kernel's body under the real ``triton.jit`` (named as SOURCES)."""
    root = _vllm_root()
    parts = ["import triton", "import triton.language as tl", ""]
    for new, (rel, cls, name) in SOURCES.items():
        code = _function_source(root / rel, cls, name)
        code = code.replace(f"def {name}(", f"def {new}(", 1)
        code = code.replace("_token_request(", "token_request(") if new != "token_request" \
            else code
        parts += ["@triton.jit", code, ""]
    d = Path(tempfile.mkdtemp(prefix="ulacache_v4_triton_"))
    path = d / "v4_metadata_triton_bodies.py"
    path.write_text("\n".join(parts))
    spec = importlib.util.spec_from_file_location("v4_metadata_triton_bodies", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# Triton reads TRITON_INTERPRET when it is first imported, when @triton.jit decorates the
# kernels and while they run: set for these imports here and for this module's tests by the
# fixture, never left in the environment (_triton_interpreter.py).
with interpreted():
    pytest.importorskip("triton")
    T = _load_triton_bodies()

pytestmark = pytest.mark.usefixtures("triton_interpreter")

SEEDS = range(12)
I32 = torch.int32


def test_fallbacks_take_the_kernels_parameters():
    """Each torch body takes its Triton kernel's parameters, in order (the dispatcher passes
    them by name, or positionally in the kernel's order)."""
    for name, (impl, params) in fb.KERNELS.items():
        rel, cls, fn = SOURCES[impl.__name__]
        # (the SWA kernel is module-level, held by its class as `kernel`)
        assert name.endswith(f"{cls}.{fn}" if cls else fn) or fn.startswith("_compute_swa"), name
        assert name.startswith("vllm." + rel[:-3].replace("/", ".") + "."), name
        kernel = getattr(T, impl.__name__)
        assert tuple(kernel.arg_names) == params, name
        if impl is not fb.token_request_mapping:
            assert tuple(inspect.signature(impl).parameters) == params, name


# --- batches -------------------------------------------------------------------------------

class Batch:
    """A step's requests: decodes first (query 1), then prefills, then padded requests of
    query length 0; ``prefix`` tokens already cached per request."""

    def __init__(self, seed: int, *, max_q: int = 90, max_prefix: int = 700, block: int = 64,
                 max_reqs: int = 6, pad_p: float = 0.15):
        g = self.g = torch.Generator().manual_seed(seed)
        r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
        self.num_decodes = r(0, max_reqs // 2)
        self.num_prefills = r(0 if self.num_decodes else 1, max_reqs - self.num_decodes)
        self.num_padded = r(0, 2)
        n = self.num_decodes + self.num_prefills
        q = [1] * self.num_decodes + [r(1, max_q) for _ in range(self.num_prefills)]
        q += [0] * self.num_padded
        prefix = [r(0, max_prefix) for _ in range(n)] + [0] * self.num_padded
        # Some prefills start at 0; some decodes sit right at block / ratio boundaries.
        for i in range(self.num_decodes, n):
            if r(0, 2) == 0:
                prefix[i] = 0
        self.q = torch.tensor(q, dtype=I32)
        self.seq_lens = self.q + torch.tensor(prefix, dtype=I32)
        self.qsl = torch.zeros(len(q) + 1, dtype=I32)
        self.qsl[1:] = torch.cumsum(self.q, 0)
        self.num_reqs = len(q)
        self.num_tokens = int(self.qsl[-1])
        self.num_decode_tokens = self.num_decodes
        # A block table wider than needed, as a slice of a wider buffer (stride > width).
        width = int(self.seq_lens.max()) // block + 2
        full = torch.randint(0, 4000, (self.num_reqs + 1, width + 5), generator=g, dtype=I32)
        self.block_table = full[: self.num_reqs, :width]
        self.block = block
        # Own slots: valid ones non-negative, PAD (-1) with probability pad_p.
        self.slot_mapping = torch.randint(0, 1 << 20, (self.num_tokens,), generator=g)
        self.slot_mapping[torch.rand(self.num_tokens, generator=g) < pad_p] = -1
        self.token_to_req = torch.repeat_interleave(torch.arange(self.num_reqs, dtype=I32),
                                                    self.q)

    def rand_i32(self, *shape, lo=-(1 << 20), hi=1 << 20):
        return torch.randint(lo, hi, shape, generator=self.g, dtype=I32)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (a != b).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} entries differ, first at " \
        f"{diff[0].tolist()}: triton {a[tuple(diff[0])]} torch {b[tuple(diff[0])]}"


# --- 1. token -> request -----------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_token_request_mapping(seed):
    b = Batch(seed)
    g = b.g
    # Tokens past the mapped ones (padding) map to 0; past num_tokens stay untouched. The
    # mapped count may exceed the device boundaries' total (it comes from the CPU copy):
    # those tokens go to the last request.
    extra = int(torch.randint(0, 300, (1,), generator=g))
    num_mapped = b.num_tokens + (int(torch.randint(0, 40, (1,), generator=g)) if seed % 2 else 0)
    num_tokens = num_mapped + extra
    out = b.rand_i32(num_tokens + 17)
    a, t = out.clone(), out.clone()
    T.token_request_mapping[((num_tokens + 255) // 256,)](
        b.qsl, a, b.num_reqs, num_mapped, num_tokens, num_warps=4)
    fb.token_request_mapping(b.qsl, t, b.num_reqs, num_mapped, num_tokens, num_warps=4)
    _equal(a, t, "token_to_req")
    assert torch.equal(t[:b.num_tokens], b.token_to_req)


# --- 2. compressed slot mapping ------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_slot_mapping(seed, ratio):
    b = Batch(seed + 100, max_q=300, max_prefix=1500, block=256)
    g = b.g
    dcp, interleave = (1, 1) if seed % 3 else (2, ratio * int(torch.randint(1, 3, (1,),
                                                                              generator=g)))
    block_size = 256 // ratio
    width = int(b.seq_lens.max()) // ratio // block_size + 2
    full = torch.randint(0, 4000, (b.num_reqs + 2, width + 3), generator=g, dtype=I32)
    bt = full[: b.num_reqs, :width]
    out = torch.full((b.num_tokens + 9,), -1, dtype=torch.int64)
    a, t = out.clone(), out.clone()
    kw = dict(block_table_stride=bt.stride(0), COMPRESS_RATIO=ratio, PAD_ID=-1)
    T.compressed_slot_mapping[(bt.shape[0],)](
        a, b.slot_mapping, b.qsl, b.seq_lens, bt, block_size=block_size, dcp_world_size=dcp,
        cp_interleave=interleave, TRITON_BLOCK_SIZE=1024, **kw)
    fb.compressed_slot_mapping(t, b.slot_mapping, b.qsl,
                               b.seq_lens, bt, kw["block_table_stride"], block_size, dcp,
                               interleave, ratio, -1, 1024)
    _equal(a, t, "compressed slot mapping")


# --- 3. indexer prefill-chunk metadata -----------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_chunk_metadata(seed, ratio):
    b = Batch(seed + 200, max_q=300, max_prefix=1500)
    g = b.g
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    # A chunk of requests [s, e), its query_start_loc rebased to 0, as the builder slices it.
    s = r(0, b.num_reqs - 1)
    e = r(s + 1, b.num_reqs)
    qsl = b.qsl[s:e + 1] - b.qsl[s]
    useq = b.seq_lens[s:e]
    comp = useq // ratio
    cu = torch.zeros(e - s + 1, dtype=I32)
    cu[1:] = torch.cumsum(comp, 0)
    total_q = int(qsl[-1])
    if seed % 3:
        qs = r(0, total_q)
        qe = r(qs, total_q)
    else:
        qs, qe = 0, total_q
    # Under DCP (odd seeds) the kernel writes this rank's local lengths.
    dcp_world = 1 if seed % 2 == 0 else r(2, 4)
    dcp_rank, dcp_inter = (0, 1) if dcp_world == 1 else (r(1, dcp_world - 1), r(2, 3))
    row_start = cu if dcp_world == 1 else torch.sort(torch.randint(0, 500, (e - s + 1,),
                                                                   generator=g,
                                                                   dtype=I32)).values
    n_out = qe - qs
    bufs = [b.rand_i32(int(cu[-1]) + 3), b.rand_i32(n_out + 2), b.rand_i32(n_out + 2)]
    a = [x.clone() for x in bufs]
    t = [x.clone() for x in bufs]
    T.prefill_chunk_metadata[(e - s,)](qsl, useq, cu, row_start, *a, qs, qe, dcp_rank,
                                       dcp_world, dcp_inter, BLOCK_SIZE=1024,
                                       COMPRESS_RATIO=ratio)
    fb.prefill_chunk_metadata(qsl, useq, cu, row_start, *t, qs, qe, dcp_rank, dcp_world,
                              dcp_inter, 1024, ratio)
    for x, y, what in zip(a, t, ("token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke")):
        _equal(x, y, what)


# --- 4. sliding-window indices and lengths --------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_swa_indices_and_lens(seed, phase):
    # A batch with tokens of this phase (the first seed after ``seed`` that has some).
    b = next(b for b in (Batch(seed + 300 + 1000 * i, max_q=70, max_prefix=400)
                         for i in range(100))
             if (b.num_decode_tokens if phase == "decode" else b.num_tokens - b.num_decode_tokens))
    g = b.g
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    window = [8, 16, 32, 128][seed % 4]
    has_image = phase == "prefill" and seed % 3 == 0
    max_tokens = b.num_tokens + 11
    is_valid = b.slot_mapping >= 0
    replay = torch.zeros(b.num_reqs + 1, dtype=I32)
    if seed % 2:
        replay[: b.num_reqs] = (b.seq_lens - b.q - torch.randint(0, 40, (b.num_reqs,),
                                                                  generator=g)).clamp(min=0)
    left = torch.randint(0, 3 * window, (max_tokens,), generator=g, dtype=I32)
    right = torch.randint(0, 20, (max_tokens,), generator=g, dtype=I32)
    if phase == "decode":
        width, offset, num_tokens = window, 0, b.num_decode_tokens
        idx = b.rand_i32(max_tokens, 1, width)
        lens = b.rand_i32(max_tokens)
    else:
        width = window + r(0, 40)  # the prefill index width is wider than the window
        offset = b.num_decode_tokens
        num_tokens = b.num_tokens - offset
        idx = b.rand_i32(max_tokens, 1, width)[:num_tokens]
        lens = b.rand_i32(max_tokens)[:num_tokens]
    assert num_tokens > 0
    args = lambda i, n: (i, i.stride(0), n, window, width,  # noqa: E731
                         left if has_image else n, right if has_image else n, b.qsl,
                         b.seq_lens, b.token_to_req, is_valid, b.block_table,
                         b.block_table.stride(0), b.block, replay, offset)
    ai, al, ti, tl_ = idx.clone(), lens.clone(), idx.clone(), lens.clone()
    T.swa_indices_and_lens[(num_tokens,)](*args(ai, al), HAS_IMAGE=has_image,
                                          TRITON_BLOCK_SIZE=1024)
    fb.swa_indices_and_lens(*args(ti, tl_), has_image, 1024)
    # The launch grid covers num_tokens rows; the fallback (which is not given the grid)
    # also writes the decode buffer's rows past them, up to the last token of the step.
    _equal(ai[:num_tokens], ti[:num_tokens], "swa indices")
    _equal(al[:num_tokens], tl_[:num_tokens], "swa lens")
    rows = min(idx.shape[0], is_valid.numel() - offset)
    _equal(ai[rows:], ti[rows:], "swa indices past the step's tokens")
    _equal(al[rows:], tl_[rows:], "swa lens past the step's tokens")


# --- 5. SWA prefill gather lengths ---------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_prefill_gather_lens(seed):
    b = next(b for b in (Batch(seed + 400 + 1000 * i) for i in range(100)) if b.num_prefills)
    window = [8, 128][seed % 2]
    replay = torch.zeros(b.num_reqs + 1, dtype=I32)
    if seed % 3 == 0:
        replay[: b.num_reqs] = torch.randint(0, 600, (b.num_reqs,), generator=b.g, dtype=I32)
    out = b.rand_i32(b.num_prefills + 3)
    a, t = out.clone(), out.clone()
    block = 1 << (b.num_prefills - 1).bit_length()
    T.prefill_gather_lens[(1,)](a, b.seq_lens, b.qsl, replay, b.num_prefills, b.num_decodes,
                                window, BLOCK_SIZE=block)
    fb.prefill_gather_lens(t, b.seq_lens, b.qsl, replay, b.num_prefills, b.num_decodes,
                           window, block)
    _equal(a, t, "prefill gather lens")
