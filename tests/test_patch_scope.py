"""The plugin alters only what it serves (issue 43.1): every patch that applies in every vLLM
process hands a model ulacache does not serve (DeepSeek-V4, a dense model) and a stock engine
to vLLM's own code unchanged. One test per hook point, each calling the hook with vLLM's
original replaced by a spy (or checking the installed hook's effect), no engine boot.

The hooks that exist for the DSA models' CPU sparse attention (`cpu_sparse_attention`,
`cpu_mla_path`) decide by model under any KV backend (stock vLLM's CPU build cannot run V3.2
at all); every other hook acts only for an engine running `--kv-backend ulacache`.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig

# The hooks are imported as `ulacache_vllm.patches.*`, the modules `apply_all` installs from. A
# bare `patches.*` import is a second copy of each module (its own globals, which a monkeypatch
# of one copy leaves unchanged in the other) and needs the repository root on sys.path
# (`python -m pytest` from it; the `pytest` script fails with ModuleNotFoundError).
import ulacache_vllm.patches.apply as apply_mod
from ulacache_vllm.engine.lines import choose_line, record_line

apply_mod.apply_all()


class Spy:
    """Stands in for vLLM's original: records its calls, returns a marker."""

    def __init__(self, ret="upstream"):
        self.calls, self.ret = [], ret

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.ret


def v4():
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"], index_topk=512)


def dense():
    return LlamaConfig(architectures=["LlamaForCausalLM"])


def dense_mla():
    return PretrainedConfig(architectures=["DeepseekV3ForCausalLM"])


def v32():
    return PretrainedConfig(architectures=["DeepseekV32ForCausalLM"], index_topk=16)


UNSERVED = {"deepseek_v4": v4, "llama": dense, "deepseek_v3_dense": dense_mla}


@pytest.fixture
def current_model(monkeypatch):
    """Make ``hf_config``'s model the one being built (what `get_current_vllm_config_or_none`
    says while vLLM constructs a model's layers)."""
    import vllm.config

    def use(hf_config):
        cfg = None if hf_config is None else SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config, use_mla=True))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)

    return use


def vllm_config(backend="vllm", hf_config=None):
    """A real VllmConfig (no model files), with the line recorded as the front end records
    it when ``backend`` is ulacache."""
    from vllm.config import VllmConfig

    extra = {}
    if backend == "ulacache":
        extra = record_line({"kv_backend": "ulacache"},
                            choose_line(SimpleNamespace(hf_config=hf_config)))
    return VllmConfig(additional_config=extra)


# ---------------------------------------------------------- cpu_sparse_attention
def _selector(use_sparse):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                   block_size=None, use_mla=True, use_sparse=use_sparse)


@pytest.mark.parametrize("model", [*UNSERVED, None])
def test_attention_backend_choice_is_vllms_for_an_unserved_model(model, current_model):
    from ulacache_vllm.patches import cpu_sparse_attention as P

    current_model(UNSERVED[model]() if model else None)
    for sparse in (True, False):
        orig = Spy()
        assert P.select_backend(orig, object, None, _selector(sparse)) == "upstream"
        assert orig.calls == [((object, None, _selector(sparse), None), {})]


def test_attention_backend_choice_through_the_installed_hook(current_model):
    """The installed `CpuPlatform.get_attn_backend_cls`: V4's sparse layer gets vLLM's own
    answer (its refusal: stock vLLM's CPU build has no sparse backend); V3.2's gets the line's."""
    from vllm.platforms.cpu import CpuPlatform

    current_model(v4())
    with pytest.raises(Exception, match="Sparse Attention is not supported on CPU"):
        CpuPlatform.get_attn_backend_cls(None, _selector(True))
    current_model(v32())
    assert CpuPlatform.get_attn_backend_cls(None, _selector(True)).endswith(
        "cpu_sparse_mla.CpuSparseMLABackend")


@pytest.fixture
def indexer_cache(current_model):
    """Builds a real `DeepseekV32IndexerCache` (through the installed hook) for a model."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    n = [0]

    def build(hf_config):
        current_model(hf_config)
        n[0] += 1
        with set_current_vllm_config(VllmConfig()):
            return DeepseekV32IndexerCache(128, torch.uint8, f"layers.{n[0]}.k_cache",
                                           CacheConfig())

    return build


@pytest.mark.parametrize("model", list(UNSERVED))
def test_indexer_cache_backend_is_vllms_for_an_unserved_model(model, indexer_cache):
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    from ulacache_vllm.engine.dsa.cpu_indexer import CpuIndexerBackend
    from ulacache_vllm.patches import cpu_sparse_attention as P

    cache = indexer_cache(UNSERVED[model]())
    assert P.support_of(cache) is None
    assert cache.get_attn_backend() is DeepseekV32IndexerBackend  # vLLM's own
    orig = Spy()
    assert P.indexer_cache_backend(orig, cache) == "upstream" and len(orig.calls) == 1
    assert indexer_cache(v32()).get_attn_backend() is CpuIndexerBackend  # the served model


@pytest.mark.parametrize("model", list(UNSERVED))
def test_indexer_forward_is_vllms_for_an_unserved_model(model, indexer_cache):
    """DeepSeek-V4's indexer is a `SparseAttnIndexer` too (its key cache is V4's own class, or
    any cache not built for a served model): its `forward_cpu` is vLLM's, arguments as given."""
    from ulacache_vllm.patches import cpu_sparse_attention as P

    args = (torch.zeros(2, 4), torch.zeros(2, 1, 4), None, torch.zeros(2, 1))
    for k_cache in (torch.nn.Module(), indexer_cache(UNSERVED[model]())):
        indexer = SimpleNamespace(k_cache=k_cache)
        orig = Spy()
        assert P.indexer_forward_cpu(orig, indexer, *args) == "upstream"
        assert orig.calls == [((indexer, *args), {})]


def test_indexer_forward_of_a_served_model_is_the_lines(indexer_cache, monkeypatch):
    from ulacache_vllm.patches import cpu_sparse_attention as P

    cache = indexer_cache(v32())
    line_forward = Spy("line")
    monkeypatch.setitem(cache.__dict__, P.SUPPORT_ATTR,
                        SimpleNamespace(indexer_forward=line_forward))
    orig = Spy()
    assert P.indexer_forward_cpu(orig, SimpleNamespace(k_cache=cache), 1, 2) == "line"
    assert not orig.calls


def test_the_torch_quant_replaces_vllms_only_where_vllms_cannot_run(monkeypatch):
    """`per_token_group_quant_fp8` as deepseek_v2.py binds it (only V3.2's indexer calls it):
    vLLM's own launches a Triton kernel, which runs only where Triton has a CPU backend."""
    from ulacache_vllm.patches import cpu_sparse_attention as P

    calls = Spy()
    monkeypatch.setattr(P, "replace", calls)
    support = SimpleNamespace(quant_fp8=object())
    monkeypatch.setattr(P, "triton_runs_here", lambda: True)
    assert P.install_quant([support]) is False and not calls.calls
    monkeypatch.setattr(P, "triton_runs_here", lambda: False)
    assert P.install_quant([support]) is True
    assert calls.calls == [((P.DSV2, "per_token_group_quant_fp8", support.quant_fp8, P.HOOK), {})]


# ------------------------------------------------------------------ cpu_mla_path
def _platform_result(hf_config, block=256):
    """A config as vLLM's CPU hook left it (block size forced), the user having asked for
    block 64, chunked prefill and prefix caching explicitly."""
    from ulacache_vllm.patches.cpu_mla_path import REQUESTED_KEY

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, use_mla=True),
        additional_config={REQUESTED_KEY: {"enable_chunked_prefill": True,
                                           "enable_prefix_caching": True}},
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False, max_num_batched_tokens=4096),
        cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=block,
                                     user_specified_block_size=True))


@pytest.mark.parametrize("model", list(UNSERVED))
def test_cpu_mla_path_keeps_vllms_decisions_for_an_unserved_model(model):
    """V4's forced block size of 256 (its only kernel block size) and the reference MLA path's
    limits on a dense MLA model stay exactly as vLLM's platform hook set them."""
    from ulacache_vllm.patches.cpu_mla_path import keep_explicit_choices

    cfg = _platform_result(UNSERVED[model]())
    before = dict(max_num_batched_tokens=2048, block_size=64)
    assert keep_explicit_choices(cfg, before) == []
    assert cfg.cache_config.block_size == 256 and not cfg.cache_config.enable_prefix_caching
    assert not cfg.scheduler_config.enable_chunked_prefill


def test_cpu_mla_path_keeps_explicit_choices_for_a_served_model():
    from ulacache_vllm.patches.cpu_mla_path import keep_explicit_choices

    cfg = _platform_result(v32(), block=16)
    kept = keep_explicit_choices(cfg, dict(max_num_batched_tokens=2048, block_size=64))
    assert len(kept) == 3 and cfg.cache_config.block_size == 64


# ------------------------------------------------- hooks of ulacache engines only
@pytest.mark.parametrize("backend,hf,skipped", [
    ("vllm", None, False), ("ulacache", v32(), False),
    ("ulacache", PretrainedConfig(architectures=["Qwen3NextForCausalLM"]), True)])
def test_hybrid_block_size_is_vllms_unless_the_line_keeps_natural_pages(backend, hf, skipped):
    from ulacache_vllm.patches.hybrid_block_size import update_block_size

    orig = Spy()
    cfg = vllm_config(backend, hf)
    update_block_size(orig, object, cfg)
    assert orig.calls == ([] if skipped else [((object, cfg), {})])


def test_kv_cache_sizing_is_vllms_for_a_stock_engine():
    from ulacache_vllm.patches.kv_cache_sizing import get_kv_cache_configs

    orig, cfg, specs, mem = Spy(), vllm_config(), [{"l": object()}], [1 << 20]
    assert get_kv_cache_configs(orig, cfg, specs, mem) == "upstream"
    assert orig.calls == [((cfg, specs, mem), {})]


def test_mamba_copies_and_block_tables_are_vllms_without_the_ulacache_connector():
    from ulacache_vllm.patches.block_table_translate import commit
    from ulacache_vllm.patches.mamba_align_translate import collect

    req = SimpleNamespace(block_ids=[[1, 2], [3]])
    orig = Spy()
    args = ("bufs", "kvc", "funcs", [1], 0, 1, 0, req, "fwd")
    assert collect(orig, *args) == "upstream" and orig.calls == [(args, {})]
    table = SimpleNamespace()
    orig = Spy()
    commit(orig, table, 3)
    assert orig.calls == [((table, 3), {})]


def test_block_hasher_is_vllms_for_a_stock_engine():
    from ulacache_vllm.patches.block_hasher import after_init

    core = SimpleNamespace(request_block_hasher="vllm's")
    after_init(core, vllm_config())
    assert core.request_block_hasher == "vllm's"
    ula = vllm_config("ulacache", v32())
    ula.cache_config.enable_prefix_caching = False
    after_init(core, ula)  # ulacache without prefix caching: nothing reads a hash
    assert core.request_block_hasher is None


def test_layer_hooks_stay_for_any_other_connector(monkeypatch):
    import vllm.distributed.kv_transfer.kv_transfer_state as state
    import vllm.model_executor.layers.attention.kv_transfer_utils as ktu

    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", None)
    assert ktu.has_kv_transfer_group() is False  # no connector: vLLM's answer
    monkeypatch.setattr(state, "_KV_CONNECTOR_AGENT", SimpleNamespace())
    assert ktu.has_kv_transfer_group() is True  # another connector keeps its layer hooks


def test_rotary_kernel_is_vllms_for_the_shapes_it_handles(monkeypatch):
    """A dense model's 2-D query/key (Llama, Qwen2) reach vLLM's CPU kernel unchanged; only
    the 3-D views vLLM's kernel mis-rotates (MLA, the DSA indexer) take the exact path."""
    import vllm._custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = Spy()
    monkeypatch.setattr(ops, "rotary_embedding", kernel)
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
    pos = torch.arange(3)
    q, k = torch.randn(3, 2 * 64), torch.randn(3, 64)
    rope.forward_cpu(pos, q, k)
    assert len(kernel.calls) == 1 and kernel.calls[0][0][1] is q
    rope.forward_cpu(pos, torch.randn(3, 2, 64), torch.randn(3, 1, 64))
    assert len(kernel.calls) == 1


def test_front_end_patches_leave_a_stock_engine_alone(tiny_model):
    """A dense model without `--kv-backend`: no line, no connector, no scheduler swap."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(tiny_model("llama")), enforce_eager=True,
                     max_model_len=256).create_engine_config()
    assert "ulacache_line" not in (cfg.additional_config or {})
    assert cfg.kv_transfer_config is None
    assert "ulacache" not in str(cfg.scheduler_config.scheduler_cls)
