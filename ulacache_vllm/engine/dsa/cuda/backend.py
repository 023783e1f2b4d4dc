"""vLLM 0.32.0's FlashMLA-sparse backend with ulacache's rows in between (experimental, CUDA).

`UlaFlashMLASparseBackend` subclasses `FlashMLASparseBackend`
(v1/attention/backends/mla/flashmla_sparse.py) and keeps its name (``FLASHMLA_SPARSE``: vLLM
keys the fp8_ds_mla canonicalisation and the flat-cache choice off that string, as its own HY V4
subclass notes). Every path that reads the KV cache goes through one conversion:

1. stock's converter (``triton_convert_req_index_to_global_index``, ``BLOCK_STRIDE_ROWS=None``)
   turns request-local top-k positions into logical slots through the logical block table, for
   decode, prefill and mixed batches alike (vLLM calls it directly outside decode-only batches,
   so overriding the index group alone would not do); the index group's own decode conversion
   is not used;
2. ulacache's resolve + stage (`runtime.CudaRows.resolve_stage`: Triton on CUDA) turn logical
   slots into rows of ``[staging | device pool]`` and copy host rows into staging;
3. stock's kernels (``_bf16_flash_mla_kernel`` / ``_fp8_flash_mla_kernel``) attend over those
   rows (the layer's KV cache *is* the `CudaRows.kv_view`).

A layer call larger than staging covers (prefill, mixed; `CudaRows.chunks`, from shapes only)
runs steps 2-3 per query-token chunk, each chunk's rows staged and attended before the next
chunk re-uses staging; outputs are concatenated (exact: a sparse query token reads only its own
selections). fp8 chunks get FlashMLA tile-scheduler metadata of their own per chunk length
(stock plans one per step and shape, shared by the layers; chunks of every layer have the same
lengths, so the plans are shared the same way).

The builder forces ``fp8_use_mixed_batch`` (fp8: one kernel for every token; the separate
prefill path would upconvert whole contexts through the logical block table), and dense-MHA
prefill is off (``sparse_mla_force_mqa``, set by `check_cuda_config`). Writes do not pass here:
`fused_norm_rope` writes through the slot mapping the runner hands the layer, which the patch
replaces with `CudaRows`' static buffer of translated rows.

DCP is refused (by config and here, in case the config check was bypassed).
"""
from __future__ import annotations

import dataclasses

import torch
from vllm.v1.attention.backends.mla import flashmla_sparse as _fms
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadataBuilder,
)

from .runtime import CudaRows

FP8_PAGE = 64  # rows per page of the fp8 decode kernel


def _chunk_meta(attn_metadata, base, n: int):
    """fp8 kernel metadata for chunks of ``n`` tokens: stock's, with a tile-scheduler plan of
    its own (FlashMLA plans on first use from the query shape), cached on the step's metadata
    so the layers share it as they share stock's."""
    cache = getattr(attn_metadata, "_ula_fp8_chunk_meta", None)
    if cache is None:
        cache = {}
        setattr(attn_metadata, "_ula_fp8_chunk_meta", cache)
    if n not in cache:
        sched, _ = _fms.get_mla_metadata()
        cache[n] = dataclasses.replace(base, scheduler_metadata=sched)
    return cache[n]


class UlaFlashMLASparseMetadataBuilder(FlashMLASparseMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every batch through the mixed-batch fp8 kernel: the separate prefill path gathers
        # whole contexts through the logical block table (rows are not there under ulacache).
        self.fp8_use_mixed_batch = True


class UlaFlashMLASparseImpl(FlashMLASparseImpl):
    """Stock forward_mqa (q concat, dispatch by cache dtype), with the two conversion paths
    replaced (module doc). ``ula_rows`` and ``layer_name`` are set when the worker registers
    the layer (`register`)."""

    ula_rows: CudaRows | None = None
    layer_name: str = ""

    def register(self, rows: CudaRows, layer_name: str) -> None:
        self.ula_rows, self.layer_name = rows, layer_name

    # -------------------------------------------------------------- conversion
    def _rows(self, kv_c_and_k_pe_cache: torch.Tensor) -> CudaRows:
        rows = self.ula_rows
        if rows is None:
            raise RuntimeError(
                f"ulacache (CUDA, experimental): sparse-MLA layer {self.layer_name or '?'} was "
                "not registered with the worker's rows: its KV cache would be read at logical "
                "slots. This is a bug in the ulacache wiring; please report it.")
        if kv_c_and_k_pe_cache.data_ptr() != rows.buf.data_ptr():
            raise RuntimeError(
                f"ulacache (CUDA, experimental): layer {self.layer_name}'s KV cache is not "
                "ulacache's [staging | device pool] buffer; the worker did not install it.")
        if self.dcp_world_size > 1:
            raise RuntimeError("ulacache (CUDA, experimental) does not support DCP; drop "
                               "--decode-context-parallel-size")
        return rows

    def _logical(self, kv_cache: torch.Tensor, topk_indices: torch.Tensor, attn_metadata,
                 with_counts: bool):
        """Stock's logical conversion of the whole call: (rows, logical slots ``[T, K]``,
        stock's valid counts when asked)."""
        rows = self._rows(kv_cache)
        req_id = attn_metadata.req_id_per_token[: topk_indices.shape[0]]
        conv = _fms.triton_convert_req_index_to_global_index(
            req_id, attn_metadata.block_table, topk_indices,
            BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=None,
            NUM_TOPK_TOKENS=topk_indices.shape[1], return_valid_counts=with_counts)
        logical, counts = conv if with_counts else (conv, None)
        return rows, logical, counts

    def _chunks(self, rows: CudaRows, logical: torch.Tensor, attn_metadata):
        """Per token chunk (`CudaRows.chunks`): its slice and its int32 rows ``[t, K]`` of the
        KV view (resolved and staged just before the chunk's attention)."""
        qsl = getattr(attn_metadata, "query_start_loc", None)
        ntok = qsl[-1:] if qsl is not None else None  # padded batch rows -> -1, no log
        for i, (t0, t1) in enumerate(rows.chunks(*logical.shape)):
            n = ntok if ntok is None or t0 == 0 else (ntok - t0).clamp(min=0)
            sl = slice(t0, t1)
            yield sl, rows.resolve_stage(self.layer_name, logical[sl], n, carry=i > 0)

    @staticmethod
    def _cat(parts: list):
        if len(parts) == 1:
            return parts[0]
        outs, lses = zip(*parts)
        lse = None if any(x is None for x in lses) else torch.cat(lses, 0)
        return torch.cat(outs, 0), lse

    # ----------------------------------------------------------------- paths
    def _forward_bf16_kv(self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata,
                         actual_num_heads):
        rows, logical, counts = self._logical(kv_c_and_k_pe_cache, topk_indices, attn_metadata,
                                              True)
        kv_rows = kv_c_and_k_pe_cache.reshape(-1, kv_c_and_k_pe_cache.shape[-1])
        return self._cat([self._bf16_flash_mla_kernel(q[sl], kv_rows, phys, counts[sl],
                                                      actual_num_heads)
                          for sl, phys in self._chunks(rows, logical, attn_metadata)])

    def _forward_fp8_kv_mixed_batch(self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata,
                                    kernel_metadata=None):
        fp8_metadata = kernel_metadata or attn_metadata.fp8_extra_metadata
        rows, logical, _ = self._logical(kv_c_and_k_pe_cache, topk_indices, attn_metadata, False)
        pages = kv_c_and_k_pe_cache.reshape(-1, FP8_PAGE, kv_c_and_k_pe_cache.shape[-1])
        outs = []
        for sl, phys in self._chunks(rows, logical, attn_metadata):
            n = sl.stop - sl.start
            meta = fp8_metadata if n == q.shape[0] else _chunk_meta(attn_metadata,
                                                                   fp8_metadata, n)
            out, _lse = self._fp8_flash_mla_kernel(
                q=q[sl].unsqueeze(0), kv_c_and_k_pe_cache=pages,
                topk_indices=phys.unsqueeze(0), kernel_metadata=meta)
            outs.append(out.squeeze(0))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, 0)), None

    def _forward_fp8_kv_separate_prefill_decode(self, *args, **kwargs):
        raise RuntimeError(
            "ulacache (CUDA, experimental): the separate fp8 prefill/decode path reads whole "
            "contexts through the logical block table; UlaFlashMLASparseMetadataBuilder forces "
            "the mixed-batch path, so reaching this is a wiring bug (was the stock builder "
            "used?).")


class UlaFlashMLASparseBackend(FlashMLASparseBackend):
    @staticmethod
    def get_builder_cls() -> type[UlaFlashMLASparseMetadataBuilder]:
        return UlaFlashMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[UlaFlashMLASparseImpl]:
        return UlaFlashMLASparseImpl


BACKEND_PATH = f"{__name__}.UlaFlashMLASparseBackend"
