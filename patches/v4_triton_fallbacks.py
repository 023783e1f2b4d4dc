"""Hook: `CpuPlatform.register_triton_kernel_overrides` (platforms/cpu.py), for DeepSeek-V4's
attention-metadata builders on vLLM's CPU build.

V4's forward on CPU is Triton-free, but its metadata builders still launch five Triton kernels:
the token-to-request mapping (`CommonAttentionMetadata.token_to_req_indices`), the compressed
slot mapping (C4/C128 rows and indexer keys), the indexer's prefill-chunk metadata, the
sliding-window indices and lengths, and the SWA prefill gather lengths. Without Triton's CPU
backend (not installable for this build) each launch fails ("Cannot inspect kernel parameters",
or a plain function that is not subscriptable), so stock V4 does not start.

vLLM's own hook for this is `vllm.triton_utils.dispatcher.register_kernels`: the CPU platform
registers 11 core kernels through it in `register_triton_kernel_overrides`, which every worker
runs right after loading the general plugins. This patch adds the five V4 kernels there, with
torch bodies that write exactly what the Triton bodies write (the tests run both under Triton's
interpreter on random inputs and compare bit for bit). Like the platform's own overrides they
are skipped where Triton can run (`HAS_TRITON`), and only the CPU platform has the hook.

The dispatcher calls an implementation once per launch, without the grid, so each function
covers every program of the launch and derives the program count from its tensors. Where the
Triton body leaves a value undefined (a masked load with no `other`) the torch body's value is
irrelevant too: the kernel overwrites it before storing.
"""
from __future__ import annotations

import inspect

import torch

from ._hook import VllmHookError, check_vllm_version, replace, resolve

HOOK = "v4_triton_fallbacks"
MODULE = "vllm.platforms.cpu"


# --- the five torch bodies ---------------------------------------------------------------

def token_request_mapping(query_start_loc, output, num_reqs, num_mapped, num_tokens, **_launch):
    """`_token_request_mapping_kernel` (v1/attention/ops/metadata.py): token t < num_mapped ->
    its request (binary search over the request ends, clamped to the last request), other
    tokens -> 0; tokens >= num_tokens untouched. Launched positionally with `num_warps`."""
    num_tokens, num_reqs = int(num_tokens), int(num_reqs)
    if num_tokens <= 0:
        return
    dev = output.device
    token = torch.arange(num_tokens, device=dev, dtype=torch.int64)
    ends = query_start_loc[1:num_reqs + 1].to(torch.int64).contiguous()
    req = torch.searchsorted(ends, token, right=True).clamp_(max=num_reqs - 1)
    output[:num_tokens] = torch.where(token < int(num_mapped), req, 0).to(output.dtype)


def _c_div(a: torch.Tensor, b) -> torch.Tensor:
    """Triton's integer `//` (C semantics: rounds toward zero)."""
    return torch.div(a, b, rounding_mode="trunc")


def _c_mod(a: torch.Tensor, b) -> torch.Tensor:
    """Triton's integer `%` (C semantics: the sign of the dividend)."""
    return torch.fmod(a, b)


def _tokens_of_requests(query_start_loc: torch.Tensor, num_reqs: int):
    """(request, offset in the request's query) of every query token of the first
    `num_reqs` requests, in order."""
    dev = query_start_loc.device
    qsl = query_start_loc[:num_reqs + 1].to(torch.int64)
    qlen = (qsl[1:] - qsl[:-1]).clamp(min=0)
    req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), qlen)
    start = torch.repeat_interleave(qsl[:-1], qlen)
    first = torch.repeat_interleave(torch.cumsum(qlen, 0) - qlen, qlen)
    off = torch.arange(req.numel(), device=dev) - first
    return req, off, start + off, qlen


def compressed_slot_mapping(compressed_slot_mapping_ptr, slot_mapping_ptr, query_start_loc_ptr,
                            seq_lens_ptr, block_table_ptr, block_table_stride, block_size,
                            dcp_world_size, cp_interleave, COMPRESS_RATIO, PAD_ID,
                            TRITON_BLOCK_SIZE):
    """`CompressedSlotMappingKernel.kernel` (v1/attention/backends/mla/compressor_utils.py):
    one program per block-table row; the last token of every COMPRESS_RATIO tokens gets its
    compressed state's slot, the others (and tokens whose own slot is PAD) PAD."""
    num_reqs = min(block_table_ptr.shape[0], query_start_loc_ptr.numel() - 1,
                   seq_lens_ptr.numel())
    if num_reqs <= 0:
        return
    req, off, tok, qlen = _tokens_of_requests(query_start_loc_ptr, num_reqs)
    if tok.numel() == 0:
        return
    start_pos = seq_lens_ptr[:num_reqs].to(torch.int64) - qlen
    pos = start_pos[req] + off
    slot = slot_mapping_ptr[tok].to(torch.int64)
    valid = (_c_mod(pos + 1, COMPRESS_RATIO) == 0) & (slot != PAD_ID)
    span = int(cp_interleave) * int(dcp_world_size)
    local_pos = _c_div(pos, span) * int(cp_interleave) + _c_mod(pos, int(cp_interleave))
    compressed = _c_div(local_pos, COMPRESS_RATIO)
    block_ids = _c_div(compressed, int(block_size))
    bt = block_table_ptr.to(torch.int64)
    safe_ids = torch.where(valid, block_ids, 0).clamp(0, bt.shape[1] - 1)
    block_numbers = torch.where(valid, bt[req, safe_ids], 0)
    slot_ids = block_numbers * int(block_size) + _c_mod(compressed, int(block_size))
    compressed_slot_mapping_ptr[tok] = torch.where(valid, slot_ids, PAD_ID).to(
        compressed_slot_mapping_ptr.dtype)


def prefill_chunk_metadata(query_start_loc_ptr, uncompressed_seq_lens_ptr,
                           cu_compressed_seq_lens_ptr, row_start_cu_compressed_seq_lens_ptr,
                           token_to_seq_ptr, cu_compressed_seq_len_ks_ptr,
                           cu_compressed_seq_len_ke_ptr, query_slice_start, query_slice_stop,
                           DCP_RANK, DCP_WORLD, DCP_INTERLEAVE, BLOCK_SIZE, COMPRESS_RATIO):
    """`BuildPrefillChunkMetadataKernel.kernel` (v1/attention/backends/mla/indexer.py): one
    program per request; per query token in [query_slice_start, query_slice_stop) the row
    start of its request's keys (ks) and row start + causal compressed length (ke), and
    token_to_seq over each request's compressed rows."""
    num_reqs = query_start_loc_ptr.numel() - 1
    if num_reqs <= 0:
        return
    dev = query_start_loc_ptr.device
    req, off, tok, qlen = _tokens_of_requests(query_start_loc_ptr, num_reqs)
    if tok.numel():
        keep = (tok >= int(query_slice_start)) & (tok < int(query_slice_stop))
        req, off, tok = req[keep], off[keep], tok[keep]
        out = tok - int(query_slice_start)
        row_start = row_start_cu_compressed_seq_lens_ptr[:num_reqs].to(torch.int64)[req]
        start_pos = (uncompressed_seq_lens_ptr[:num_reqs].to(torch.int64) - qlen)[req]
        length = _c_div(start_pos + 1 + off, COMPRESS_RATIO)
        if DCP_WORLD > 1:
            base = _c_div(_c_div(length, DCP_INTERLEAVE), DCP_WORLD) * DCP_INTERLEAVE
            rem = length - base * DCP_WORLD
            rem = (rem - DCP_RANK * DCP_INTERLEAVE).clamp(min=0).clamp(max=DCP_INTERLEAVE)
            length = base + rem
        cu_compressed_seq_len_ks_ptr[out] = row_start.to(cu_compressed_seq_len_ks_ptr.dtype)
        cu_compressed_seq_len_ke_ptr[out] = (row_start + length).to(
            cu_compressed_seq_len_ke_ptr.dtype)
    cu = cu_compressed_seq_lens_ptr[:num_reqs + 1].to(torch.int64)
    n = (cu[1:] - cu[:-1]).clamp(min=0)
    if int(n.sum()):
        seq = torch.repeat_interleave(torch.arange(num_reqs, device=dev), n)
        first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        rows = torch.repeat_interleave(cu[:-1], n) + torch.arange(seq.numel(), device=dev) - first
        token_to_seq_ptr[rows] = seq.to(token_to_seq_ptr.dtype)


def swa_indices_and_lens(swa_indices_ptr, swa_indices_stride, swa_lens_ptr, window_size,
                         index_width, left_visible_ptr, right_visible_ptr, query_start_loc_ptr,
                         seq_lens_ptr, token_to_req_indices_ptr, is_valid_token_ptr,
                         block_table_ptr, block_table_stride, block_size, replay_start_ptr,
                         token_offset, HAS_IMAGE, TRITON_BLOCK_SIZE):
    """`_compute_swa_indices_and_lens_kernel` (v1/attention/backends/mla/sparse_swa.py): per
    output row p (token p + token_offset) the causal window's length and its paged slots,
    -1 padded to index_width; an invalid token gets length 0 and a row of -1.

    The launch grid (num_tokens) is not passed to overrides: rows run up to the last token
    `is_valid_token` covers (bounded by the output buffers). The decode launch hands over its
    whole buffer, so rows past the decode tokens are written too; they are outside the
    slices the builder returns."""
    token_offset = int(token_offset)
    rows = min(swa_lens_ptr.numel(), swa_indices_ptr.shape[0],
               is_valid_token_ptr.numel() - token_offset)
    width = int(index_width)
    if rows <= 0 or width <= 0:
        return
    dev = swa_lens_ptr.device
    out_idx = torch.as_strided(swa_indices_ptr, (rows, width), (int(swa_indices_stride), 1))
    tok = torch.arange(rows, device=dev) + token_offset
    valid = is_valid_token_ptr[tok].to(torch.bool)
    req = torch.where(valid, token_to_req_indices_ptr[tok].to(torch.int64), 0)
    qsl = query_start_loc_ptr.to(torch.int64)
    query_start = qsl[req]
    prefix_len = seq_lens_ptr.to(torch.int64)[req] - (qsl[req + 1] - query_start)
    pos = prefix_len + tok - query_start
    if HAS_IMAGE:
        left = left_visible_ptr[tok].to(torch.int64)
        right = right_visible_ptr[tok].to(torch.int64)
    else:
        left = right = torch.zeros_like(pos)
    left_add = (left - (int(window_size) - 1)).clamp(min=0)
    start = (pos - (int(window_size) - 1) - left_add).clamp(min=0)
    start = torch.maximum(start, replay_start_ptr.to(torch.int64)[req])
    end = pos + right + 1
    swa_len = end - start
    swa_lens_ptr[:rows] = torch.where(valid, swa_len, 0).to(swa_lens_ptr.dtype)

    offset = torch.arange(width, device=dev)
    in_window = valid[:, None] & (offset[None, :] < swa_len[:, None])
    pos_off = start[:, None] + offset[None, :]
    bt = block_table_ptr.to(torch.int64)
    block_idx = torch.where(in_window, _c_div(pos_off, int(block_size)), 0)
    block_idx = block_idx.clamp(0, bt.shape[1] - 1)
    block_numbers = bt[req[:, None].expand_as(block_idx), block_idx]
    slots = block_numbers * int(block_size) + _c_mod(pos_off, int(block_size))
    out_idx.copy_(torch.where(in_window, slots, -1).to(swa_indices_ptr.dtype))


def prefill_gather_lens(prefill_gather_lens_ptr, seq_lens_ptr, query_start_loc_ptr,
                        replay_start_ptr, num_prefills, num_decodes, window_size, BLOCK_SIZE):
    """`ComputePrefillMetadataKernel.kernel` (v1/attention/backends/mla/sparse_swa.py): per
    prefill request, its query length plus the part of its window before the query (not
    below its replay start)."""
    n, d = int(num_prefills), int(num_decodes)
    if n <= 0:
        return
    seq = seq_lens_ptr[d:d + n].to(torch.int64)
    qsl = query_start_loc_ptr[d:d + n + 1].to(torch.int64)
    query_len = qsl[1:] - qsl[:-1]
    visible = (seq - query_len - replay_start_ptr[d:d + n].to(torch.int64)).clamp(min=0)
    gather = query_len + visible.clamp(max=int(window_size) - 1)
    prefill_gather_lens_ptr[:n] = gather.to(prefill_gather_lens_ptr.dtype)


# --- registration --------------------------------------------------------------------------

# Kernel name (as register_kernels takes it) -> (torch body, the Triton kernel's parameters).
KERNELS: dict[str, tuple] = {
    "vllm.v1.attention.ops.metadata._token_request_mapping_kernel": (
        token_request_mapping,
        ("query_start_loc", "output", "num_reqs", "num_mapped", "num_tokens")),
    "vllm.v1.attention.backends.mla.compressor_utils.CompressedSlotMappingKernel.kernel": (
        compressed_slot_mapping,
        tuple(inspect.signature(compressed_slot_mapping).parameters)),
    "vllm.v1.attention.backends.mla.indexer.BuildPrefillChunkMetadataKernel.kernel": (
        prefill_chunk_metadata,
        tuple(inspect.signature(prefill_chunk_metadata).parameters)),
    "vllm.v1.attention.backends.mla.sparse_swa.ComputeSWAIndicesAndLensKernel.kernel": (
        swa_indices_and_lens,
        tuple(inspect.signature(swa_indices_and_lens).parameters)),
    "vllm.v1.attention.backends.mla.sparse_swa.ComputePrefillMetadataKernel.kernel": (
        prefill_gather_lens,
        tuple(inspect.signature(prefill_gather_lens).parameters)),
}


def _kernel_params(name: str) -> tuple[str, ...]:
    """The parameter names of vLLM's kernel `name` (its Triton body, or the plain function
    where Triton is a placeholder), failing loudly if it moved."""
    module, _, attr = name.rpartition(".")
    owner_path, _, cls = module.rpartition(".")
    if cls[:1].isupper():
        _, kernel = resolve(owner_path, f"{cls}.{attr}", HOOK)
        kernel = getattr(kernel, "__func__", kernel)  # staticmethod
    else:
        _, kernel = resolve(module, attr, HOOK)
    names = getattr(kernel, "arg_names", None)
    if names is None:
        fn = getattr(kernel, "func", None) or getattr(kernel, "fn", None) or kernel
        if getattr(fn, "__ulacache_patch__", None) == HOOK:  # already ours
            return KERNELS[name][1]
        names = tuple(inspect.signature(fn).parameters)
    return tuple(names)


def check_kernels() -> None:
    """Each kernel is where this patch expects it, with the parameters its torch body takes."""
    check_vllm_version(HOOK)
    for name, (_, params) in KERNELS.items():
        found = _kernel_params(name)
        if found != params:
            raise VllmHookError(
                f"ulacache patch '{HOOK}': {name} now takes {found}, its torch fallback was "
                f"written for {params}; port the fallback")


def register() -> bool:
    """Registers the five torch bodies with vLLM's dispatcher (once), unless Triton can run
    here. Returns whether they are registered."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    from vllm.triton_utils import dispatcher

    todo = {}
    for name, (impl, _) in KERNELS.items():
        registered = dispatcher._registry.get(name)
        if registered is None or registered[1] is not impl:
            todo[name] = impl
    if todo:
        check_kernels()
        for impl in todo.values():
            impl.__ulacache_patch__ = HOOK
        dispatcher.register_kernels(todo)
    return True


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    _, cur = resolve(MODULE, "CpuPlatform.register_triton_kernel_overrides", HOOK)
    if getattr(cur, "__ulacache_patch__", None) == HOOK:
        return
    orig = cur.__func__

    def register_triton_kernel_overrides(cls) -> None:
        orig(cls)
        register()

    replace(MODULE, "CpuPlatform.register_triton_kernel_overrides",
            classmethod(register_triton_kernel_overrides), HOOK)
