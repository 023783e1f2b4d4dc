"""The product line is one object, chosen once from the model config by `lines.choose_line`,
recorded in `additional_config` and read back from there (issue 42, item 2); DeepSeek-V4 gets
its own line (issue 44), and the rest of its family is refused under `--kv-backend ulacache`
with what to use instead (issue 43, item 6)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, PretrainedConfig

from ulacache_vllm.engine import lines
from ulacache_vllm.engine.config import KVBackendError
from ulacache_vllm.engine.line import Line

ROOT = Path(__file__).resolve().parent.parent


def _v4_config(arch="DeepseekV4ForCausalLM", **kw):
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(architectures=[arch], index_topk=512, **kw)


def _mc(hf_config):
    return SimpleNamespace(hf_config=hf_config)


@pytest.mark.parametrize("archs,extra,want", [
    (["DeepseekV32ForCausalLM"], {"index_topk": 16}, "dsa"),
    (["GlmMoeDsaForCausalLM"], {"index_topk": 16}, "dsa"),
    (["DeepseekV3ForCausalLM"], {"index_topk": 16}, "dsa"),  # vLLM runs it on V3.2's code
    (["DeepSeekMTPModel"], {"index_topk": 16}, "dsa"),  # a V3.2 model's MTP draft
    (["Qwen3NextForCausalLM"], {}, "arena"),
    (["GptOssForCausalLM"], {}, "arena"),
    (["Gemma3ForCausalLM"], {}, "arena"),
])
def test_each_model_gets_its_line(archs, extra, want):
    line = lines.choose_line(_mc(PretrainedConfig(architectures=archs, **extra)))
    assert line.name == want and line is lines.line_named(want)


@pytest.mark.parametrize("hf", [
    LlamaConfig(architectures=["LlamaForCausalLM"]),
    PretrainedConfig(architectures=["DeepseekV3ForCausalLM"]),  # dense MLA, no indexer
    PretrainedConfig(architectures=["NemotronHForCausalLM"]),
    PretrainedConfig(architectures=["Glm5NextForCausalLM"], index_topk=16),  # not V3.2's code
])
def test_a_model_no_line_serves_is_refused_naming_what_each_line_serves(hf):
    with pytest.raises(KVBackendError) as e:
        lines.choose_line(_mc(hf))
    msg = str(e.value)
    assert hf.architectures[0] in msg and "--kv-backend vllm" in msg
    assert "DeepseekV32ForCausalLM" in msg and "Qwen3NextForCausalLM" in msg
    assert lines.line_serving(hf) is None


def _v4_family_architectures() -> list[str]:
    """Every architecture vLLM's registry runs from the DeepSeek-V4 packages."""
    from vllm.model_executor.models.registry import ModelRegistry

    from ulacache_vllm.engine.dsa.line import V4_MODULES, vllm_module_of

    return sorted(a for a in ModelRegistry.models
                  if (vllm_module_of(a) or "").startswith(V4_MODULES))


def test_the_v4_family_is_found_in_vllms_registry():
    archs = _v4_family_architectures()
    assert {"DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"} <= set(archs), archs


@pytest.mark.parametrize("arch", _v4_family_architectures())
def test_deepseek_v4_gets_its_line_and_the_rest_of_its_family_is_refused(arch):
    """Issue 44: DeepseekV4ForCausalLM is the V4 line's; every other architecture of the
    family (V4.1, the drafts) is refused naming itself, the family and the fix (not the DSA
    line's misleading "other KV layers"), and no line serves it (the patches leave it to vLLM)."""
    if arch == "DeepseekV4ForCausalLM":
        line = lines.choose_line(_mc(_v4_config(arch)))
        assert line.name == "v4" and lines.line_serving(_v4_config(arch)) is line
        assert line.cpu_sparse_attention() is None  # V4's layers keep vLLM's own CPU code
        return
    with pytest.raises(KVBackendError) as e:
        lines.choose_line(_mc(_v4_config(arch)))
    msg = str(e.value)
    assert "DeepSeek-V4" in msg and arch in msg and "--kv-backend vllm" in msg
    assert lines.line_serving(_v4_config(arch)) is None


def test_deepseek_v4_family_is_refused_by_model_type_alone():
    hf = _v4_config()
    hf.architectures = ["SomeFutureV4Name"]
    with pytest.raises(KVBackendError, match="DeepSeek-V4"):
        lines.choose_line(_mc(hf))


@pytest.mark.timeout(300)
def test_engine_args_with_deepseek_v4_and_ulacache_record_the_v4_line(tmp_path, monkeypatch):
    """Through the real front end (`EngineArgs.create_engine_config`, as `vllm serve` and
    `LLM(...)` build it): V4 under ulacache records the v4 line, before any engine starts;
    V4.1 is refused there. (The CPU's AVX512-BF16 probe answers yes: no kernel is loaded
    here, and a host without it refuses V4 before the line is chosen.)"""
    import ulacache_vllm.patches.apply as patches
    from ulacache_vllm.patches import v4_cpu_isa
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(v4_cpu_isa, "host_has_avx512_bf16", lambda: True)
    patches.apply_all()
    cfg = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
           "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2,
           "compress_ratios": [0, 4], "num_attention_heads": 8, "num_key_value_heads": 1,
           "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_lora_rank": 128,
           "o_groups": 2, "sliding_window": 128, "index_topk": 512, "index_n_heads": 16,
           "index_head_dim": 128, "rope_parameters": {"rope_type": "default"},
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ea = EngineArgs(model=str(tmp_path), kv_backend="ulacache", skip_tokenizer_init=True,
                    enforce_eager=True, dtype="bfloat16")
    vc = ea.create_engine_config()
    assert vc.additional_config[lines.LINE_KEY] == "v4"
    assert vc.scheduler_config.async_scheduling is False
    assert vc.cache_config.block_size == 256  # V4's own CPU block, kept
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["DeepSeekV4MTPModel"]}))
    ea = EngineArgs(model=str(tmp_path), kv_backend="ulacache", skip_tokenizer_init=True,
                    enforce_eager=True, dtype="bfloat16")
    with pytest.raises(KVBackendError) as e:
        ea.create_engine_config()
    assert "DeepSeek-V4" in str(e.value) and "--kv-backend vllm" in str(e.value)


def test_the_choice_is_recorded_and_read_back():
    from vllm.config import VllmConfig

    mc = _mc(PretrainedConfig(architectures=["GptOssForCausalLM"]))
    extra = lines.record_line({"kv_backend": "ulacache", "other": 1}, lines.choose_line(mc))
    assert extra == {"kv_backend": "ulacache", "other": 1, lines.LINE_KEY: "arena"}
    assert lines.recorded_line(VllmConfig(additional_config=extra)).name == "arena"
    # A stock engine has no line, whatever is recorded.
    assert lines.recorded_line(VllmConfig(additional_config={lines.LINE_KEY: "arena"})) is None
    assert lines.recorded_line(VllmConfig()) is None
    with pytest.raises(RuntimeError, match="no line recorded"):
        lines.recorded_line(VllmConfig(additional_config={"kv_backend": "ulacache"}))
    with pytest.raises(KVBackendError, match="unknown ulacache line 'nope'"):
        lines.line_named("nope")


def test_a_third_line_is_one_more_entry_in_the_list():
    """The choice asks each line in order (refusals first); nothing in the glue changes."""

    class Third(Line):
        name = "third"
        serves_text = "the third kind"

        def serves(self, hf_config):
            return "ThirdForCausalLM" in (hf_config.architectures or ())

    third = Third()
    with_third = lines.LINES + (third,)
    hf = PretrainedConfig(architectures=["ThirdForCausalLM"])
    assert lines.choose_line(_mc(hf), with_third) is third
    assert lines.line_named("third", with_third) is third
    with pytest.raises(KVBackendError, match="the third kind"):
        lines.choose_line(_mc(LlamaConfig(architectures=["LlamaForCausalLM"])), with_third)


def test_each_line_brings_its_metrics():
    from ulacache_vllm.engine.arena.metrics import ARENA_COUNTERS, ARENA_GAUGES

    dsa, arena = lines.line_named("dsa"), lines.line_named("arena")
    assert set(arena.metrics.counters) == set(ARENA_COUNTERS) | {"failed_copies"}
    assert set(arena.metrics.gauges) == set(ARENA_GAUGES)
    assert {"lookups", "hits", "promotions", "failed_copies"} <= set(dsa.metrics.counters)
    assert not set(dsa.metrics.gauges) & set(arena.metrics.gauges)
    for line in lines.LINES:
        assert all(h.strip() for h in {**line.metrics.counters, **line.metrics.gauges}.values())


def test_stats_travel_without_tables():
    """Counters add up over steps and ranks; gauges are per rank, latest report, summed."""
    from ulacache_vllm.engine.metrics import UlaStats, per_rank_gauges

    a = UlaStats(data={"promotions": 2, **per_rank_gauges({"device_used": 5}, 0)})
    a.aggregate(UlaStats(data={"promotions": 3, **per_rank_gauges({"device_used": 7}, 1)}))
    a.aggregate(UlaStats(data=per_rank_gauges({"device_used": 1}, 0)))
    assert a.reduce() == {"promotions": 5, "device_used": 8}


# ------------------------------------------------------- the glue names no line
GLUE = sorted([*(ROOT / "ulacache_vllm" / "engine").glob("*.py"), *(ROOT / "patches").glob("*.py")])
LINE_CHOICE = {ROOT / "ulacache_vllm" / "engine" / "lines.py"}
PRODUCT_WORDS = ("dsa", "arena")


def _identifiers(path: Path) -> set[str]:
    """Names, attributes, definitions and imported module paths of a file (strings and
    comments are text, not identifiers)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.ImportFrom):
            out.update((node.module or "").split("."))
            out.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                out.update(a.name.split("."))
                if a.asname:
                    out.add(a.asname)
    return out


@pytest.mark.parametrize("path", [p for p in GLUE if p not in LINE_CHOICE],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_glue_names_no_product_line(path):
    def words(i: str) -> set[str]:  # snake_case and CamelCase parts, lowered
        return {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", i)}

    from ulacache_vllm.engine.config import UlaSettings

    # (A setting's name is its user-facing flag, `--ula-<name>`: not the glue's logic.)
    flags = set(UlaSettings.__dataclass_fields__)
    named = sorted(i for i in _identifiers(path) - flags
                   if words(i) & set(PRODUCT_WORDS)
                   or (i.startswith("is_") and i.endswith("_model")))
    assert not named, f"{path.relative_to(ROOT)} names a product line: {named}"


def test_lost_blocks_are_looked_up_among_every_request_holding_blocks():
    """A failed copy's lost blocks end the requests holding them: the running ones and the
    waiting ones vLLM lets keep their blocks (streaming sessions between inputs, which vLLM's
    own mapping skips); `finish_requests` ends either."""
    from ulacache_vllm.engine.scheduler import _UlaSchedulerMixin

    seen = {}

    def owners(ids, holders, default):
        seen.update(ids=ids, holders=list(holders))
        return {"held-while-waiting"}

    sched = SimpleNamespace(running=["r1", "r2"], kv_holding_waiting=["w1"],
                            kv_cache_manager=SimpleNamespace(lost_block_owners=owners))
    got = _UlaSchedulerMixin._handle_invalid_blocks(sched, {-3, 7}, {})
    assert got == {"held-while-waiting"}
    assert seen == {"ids": {-3, 7}, "holders": ["r1", "r2", "w1"]}


def test_the_dsa_line_also_ends_a_waiting_request_holding_a_lost_block():
    """The DSA line maps running requests through vLLM's own mapping; a waiting request that
    keeps its blocks (vLLM's mapping skips it) and holds a lost block ends too, and the block
    leaves the prefix cache; a waiting request holding none, and free uncached blocks, stay."""
    from vllm.v1.request import RequestStatus

    from ulacache_vllm.engine.dsa.manager import UlaKVCacheManager

    evicted = []
    blocks = {b: SimpleNamespace(ref_cnt=1, block_hash="h") for b in range(8)}
    blocks[6] = SimpleNamespace(ref_cnt=0, block_hash="h")  # free, cached
    blocks[7] = SimpleNamespace(ref_cnt=0, block_hash=None)  # free
    held = {"run": [1, 2], "wait": [3, 4], "wait-ok": [5]}
    mgr = SimpleNamespace(block_pool=SimpleNamespace(blocks=blocks),
                          evict_blocks=lambda ids: evicted.append(set(ids)),
                          get_block_ids=lambda rid: (held[rid],))
    holders = [SimpleNamespace(request_id="run", status=RequestStatus.RUNNING),
               SimpleNamespace(request_id="wait", status=RequestStatus.WAITING),
               SimpleNamespace(request_id="wait-ok", status=RequestStatus.WAITING)]
    got = UlaKVCacheManager.lost_block_owners(mgr, {2, 4, 6, 7}, holders, lambda: {"run"})
    assert got == {"run", "wait"}
    assert evicted == [{6}, {4}]
