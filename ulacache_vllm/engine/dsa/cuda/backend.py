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

The builder forces ``fp8_use_mixed_batch`` (fp8: one kernel for every token; the separate
prefill path would upconvert whole contexts through the logical block table), and dense-MHA
prefill is off (``sparse_mla_force_mqa``, set by `check_cuda_config`). Writes do not pass here:
`fused_norm_rope` writes through the slot mapping the runner hands the layer, which the patch
replaces with `CudaRows`' static buffer of translated rows.

DCP is refused (by config and here, in case the config check was bypassed).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backends.mla import flashmla_sparse as _fms
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    FlashMLASparseBackend,
    FlashMLASparseImpl,
    FlashMLASparseMetadataBuilder,
)

from .runtime import CudaRows

FP8_PAGE = 64  # rows per page of the fp8 decode kernel


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

    def _resolved(self, kv_cache: torch.Tensor, topk_indices: torch.Tensor, attn_metadata,
                  with_counts: bool):
        """Stock's logical conversion, then resolve + stage: int32 rows ``[T, K]`` of
        ``kv_cache``'s flat rows (and stock's valid counts when asked)."""
        rows = self._rows(kv_cache)
        req_id = attn_metadata.req_id_per_token[: topk_indices.shape[0]]
        conv = _fms.triton_convert_req_index_to_global_index(
            req_id, attn_metadata.block_table, topk_indices,
            BLOCK_SIZE=attn_metadata.block_size, BLOCK_STRIDE_ROWS=None,
            NUM_TOPK_TOKENS=topk_indices.shape[1], return_valid_counts=with_counts)
        logical, counts = conv if with_counts else (conv, None)
        qsl = getattr(attn_metadata, "query_start_loc", None)
        ntok = qsl[-1:] if qsl is not None else None  # padded batch rows -> -1, no log
        phys = rows.resolve_stage(self.layer_name, logical, ntok)
        return phys, counts

    # ----------------------------------------------------------------- paths
    def _forward_bf16_kv(self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata,
                         actual_num_heads):
        phys, counts = self._resolved(kv_c_and_k_pe_cache, topk_indices, attn_metadata, True)
        kv_rows = kv_c_and_k_pe_cache.reshape(-1, kv_c_and_k_pe_cache.shape[-1])
        return self._bf16_flash_mla_kernel(q, kv_rows, phys, counts, actual_num_heads)

    def _forward_fp8_kv_mixed_batch(self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata,
                                    kernel_metadata=None):
        fp8_metadata = kernel_metadata or attn_metadata.fp8_extra_metadata
        phys, _ = self._resolved(kv_c_and_k_pe_cache, topk_indices, attn_metadata, False)
        pages = kv_c_and_k_pe_cache.reshape(-1, FP8_PAGE, kv_c_and_k_pe_cache.shape[-1])
        out, _lse = self._fp8_flash_mla_kernel(
            q=q.unsqueeze(0), kv_c_and_k_pe_cache=pages, topk_indices=phys.unsqueeze(0),
            kernel_metadata=fp8_metadata)
        return out.squeeze(0), None

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
