"""Stock DeepSeek-V4 on vLLM's CPU build with ulacache installed (issue 43, items 2-5).

- The tiny V4 of the model factory (``python -m ulacache_vllm.models build deepseek_v4``):
  reproducible, every layer kind, ``--set`` for any key, a clear error for the shapes V4's CPU
  kernels refuse, and a checkpoint transformers' own DeepSeek-V4 loads completely.
- The patches V4 needs on this build (``patches/v4_*.py``): the five Triton metadata kernels'
  torch fallbacks registered through vLLM's dispatcher hook (their parity with the Triton
  bodies is ``tests/core/test_v4_metadata_kernels.py``), the tile-scheduler fix, and the
  AVX512-BF16 requirement checked while the config is built.
- One engine script (module-scoped, ``LLM(...)`` with the plugin loaded as installed): a CPU
  without AVX512-BF16 (the probe mocked) is refused before any engine starts; then short
  prompts and a 2400-token one (past 4 x 512: the real lightning indexer runs) generate
  greedily, deterministically, prompt-dependently and batch-invariantly, and agree with
  transformers' DeepSeek-V4 on the same weights (``_v4_reference``: tolerances there). Then, in
  the same process once that engine is freed, lm-eval's ``vllm`` model serves the same model:
  generate_until and loglikelihood agree with LLM's greedy tokens and logprobs.
- `vllm serve` (the project's serve script) gives LLM's greedy tokens with the stock backend
  and with `--kv-backend ulacache` (the V4 line; its parity under pressure is
  ``test_v4_line.py``).
- Bit for bit only where two runs compute the same shapes (a prompt resent, the same steps,
  the same batch): elsewhere (alone against batched, prefill against decode) the GEMMs round
  by their shapes, differently by host, so those comparisons allow bf16 noise, near ties and
  routing near-ties, each bounded, and a fault's nats still fail them.
- Beside it, the same generations with ulacache's plugin not loaded (``VLLM_PLUGINS``) and only
  V4's three fixes applied by hand: tokens and logprobs identical, bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from _vllm_subprocess import (IN_PROCESS, NO_V4_KERNELS, host_runs_v4, run_side_by_side,
                              run_vllm_script)

V4 = "deepseek_v4"
LONG_TOKENS = 2400  # > 4 x index_topk (2048): the indexer's top-k is real
MAX_MODEL_LEN = 2560
MAX_TOKENS = 8
SHORT_PROMPTS = ["The quick answer is", "Write a function that",
                 "Tiered memory keeps the hot rows close and the cold rows far away; the "
                 "indexer decides which rows a query reads."]


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


# --- the tiny V4 -------------------------------------------------------------------------------

def test_build_is_reproducible_and_seeded(tiny_model, tmp_path):
    from ulacache_vllm.models import ALL_MODEL_NAMES, build_model

    assert V4 in ALL_MODEL_NAMES
    cached = tiny_model(V4)
    again = build_model(V4, tmp_path / "a", seed=0)
    assert _hashes(again) == _hashes(cached)
    other = build_model(V4, tmp_path / "b", seed=1)
    assert _hashes(other)["model.safetensors"] != _hashes(cached)["model.safetensors"]
    assert _hashes(other)["tokenizer.json"] == _hashes(cached)["tokenizer.json"]


def test_config_is_valid_for_the_cpu_kernels(tiny_model):
    from safetensors import safe_open

    d = tiny_model(V4)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == V4
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"],
            cfg["index_topk"]) == (512, 64, 128, 512)
    assert set(cfg["compress_ratios"]) == {0, 4, 128}  # SWA-only, CSA and HCA layers
    assert cfg["num_hash_layers"] >= 1 and cfg["num_hash_layers"] < cfg["num_hidden_layers"]
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        norm = f.get_tensor("layers.0.attn_norm.weight")
        wq = f.get_tensor("layers.0.attn.wq_a.weight").float()
    csa = cfg["compress_ratios"].index(4)
    assert f"layers.{csa}.attn.indexer.compressor.wkv.weight" in names
    assert "layers.0.ffn.gate.tid2eid" in names and f"layers.{csa}.ffn.gate.bias" in names
    assert bool((norm == 1).all())  # norms 1, matrices scaled by fan-in
    assert abs(wq.std().item() * cfg["hidden_size"] ** 0.5 - 1) < 0.05


def test_set_overrides_any_key(tmp_path, capsys):
    from safetensors import safe_open

    from ulacache_vllm.models.__main__ import main

    out = tmp_path / "m"
    assert main(["build", V4, str(out), "--seed", "3", "--set", "num_hidden_layers=4",
                 "--set", "compress_ratios=[4,0,128,4]", "--set", "sliding_window=64",
                 "--set", "rope_theta=20000.0", "--set", "num_experts_per_tok=8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["compress_ratios"], cfg["sliding_window"],
            cfg["rope_theta"], cfg["num_experts_per_tok"]) == (4, [4, 0, 128, 4], 64, 20000.0, 8)
    assert json.loads((out / "ulacache_build.json").read_text())["seed"] == 3
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "layers.3.attn.indexer.weights_proj.weight" in set(f.keys())
        assert tuple(f.get_slice("layers.0.ffn.gate.tid2eid").get_shape()) == (512, 8)


@pytest.mark.parametrize("override, needle", [
    ("index_topk=256", "topk_transform_512_cpu"),
    ("head_dim=256", "flash_mla_with_kvcache_cpu"),
    ("index_head_dim=64", "fp8_paged_mqa_logits_cpu"),
    ("o_lora_rank=100", "bmm_cpu"),
    ("n_routed_experts=32", "biased_topk_cpu"),
    ("num_experts_per_tok=4", "6 or 8"),
    ("compress_ratios=[0,2,128]", "4 (CSA) or 128 (HCA)"),
    ("hc_mult=1", "mHC"),
    ("dtype=float16", "bfloat16"),
])
def test_refuses_shapes_the_kernels_refuse(tmp_path, capsys, override, needle):
    from ulacache_vllm.models import build_model
    from ulacache_vllm.models.__main__ import main
    from ulacache_vllm.models.deepseek_v4 import V4ConfigError

    assert main(["build", V4, str(tmp_path / "m"), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: deepseek_v4:") and needle in err, err
    assert not (tmp_path / "m").exists() and not list(tmp_path.iterdir())
    key, _, raw = override.partition("=")
    with pytest.raises(V4ConfigError, match="deepseek_v4"):
        build_model(V4, tmp_path / "m2", overrides={key: json.loads(raw) if raw[0] in "[0123456789"
                                                    else raw})


def test_transformers_loads_every_tensor(tiny_model):
    """transformers' DeepSeek-V4 (the reference) takes the checkpoint's DeepSeek names whole:
    nothing missing, unexpected or mis-shaped, and the output depends on the prompt."""
    import torch

    import _v4_reference as ref
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_model(V4)
    model, info = AutoModelForCausalLM.from_pretrained(str(d), config=ref.hf_config(d),
                                                       dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                          "error_msgs")), info
    tok = AutoTokenizer.from_pretrained(str(d))
    lp = [ref.teacher_forced_logprobs(model.eval(), tok(p)["input_ids"], [0])[0]
          for p in SHORT_PROMPTS[:2]]
    assert all(torch.isfinite(x).all() for x in lp)
    assert (lp[0] - lp[1]).abs().max() > 0.1


# --- the patches (no engine) -------------------------------------------------------------------

def test_tile_scheduler_returns_every_layer_type():
    from ulacache_vllm.patches import v4_tile_scheduler as p

    p.apply()
    from vllm.models.deepseek_v4.cpu.cpu_mla import DeepseekV4CPUSparseSWAMetadataBuilder as B

    # (the CPU builder reads nothing from self)
    assert B.build_tile_scheduler(None, 4) == {k: None for k in p.layer_types()}
    assert set(p.layer_types()) == {"swaonly", "c4a", "c128a", "c1a", "c2a"}
    p.apply()  # idempotent
    assert getattr(B.build_tile_scheduler, "__ulacache_patch__", None) == p.HOOK


def test_fallbacks_registered_by_the_platform_hook(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON, dispatcher

    from ulacache_vllm.patches import _hook
    from ulacache_vllm.patches import v4_triton_fallbacks as p

    assert not HAS_TRITON  # this build's Triton has no CPU backend
    # vLLM 0.32.0's `_rebind_kernels` scans every module in sys.modules and crashes on
    # llvmlite's lazy `ffi.lib` (its __getattr__ answers `__dict__` with a function wrapper);
    # a worker calls the hook before anything imports numba, but an earlier test of this
    # process may have: hide those modules from the scan, as a fresh worker has them.
    for mod in [m for m in sys.modules if m.split(".")[0] in ("llvmlite", "numba")]:
        monkeypatch.delitem(sys.modules, mod)
    p.apply()
    p.apply()
    CpuPlatform.register_triton_kernel_overrides()
    CpuPlatform.register_triton_kernel_overrides()  # idempotent
    import vllm.v1.attention.backends.mla.sparse_swa as swa
    import vllm.v1.attention.ops.metadata as md

    for name, (impl, _) in p.KERNELS.items():
        assert dispatcher._registry[name][1] is impl, name
    assert md._token_request_mapping_kernel.func is p.token_request_mapping
    assert swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL.kernel.func is p.swa_indices_and_lens
    # The hook moved (a kernel's parameters changed): a loud error naming it.
    name = next(iter(p.KERNELS))
    monkeypatch.setitem(p.KERNELS, name, (p.KERNELS[name][0], ("query_start_loc", "out")))
    with pytest.raises(_hook.VllmHookError, match="port the fallback"):
        p.check_kernels()


def _model_config(model_type="deepseek_v4", dtype=None):
    import torch

    return SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type),
                           dtype=dtype or torch.bfloat16)


def test_avx512_bf16_required(monkeypatch):
    """A CPU without AVX512-BF16 (vLLM's own probe mocked) gets an error naming it from the
    platform hook every config goes through; other models pass; bfloat16 is required too."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    from ulacache_vllm.patches import v4_cpu_isa as p

    p.apply()
    hook = CpuPlatform.apply_config_platform_defaults
    if host_runs_v4():  # this host's own answer first, probes unmocked
        hook(SimpleNamespace(model_config=_model_config()))
    else:
        with pytest.raises(p.DeepseekV4CpuError, match="AVX512-BF16"):
            hook(SimpleNamespace(model_config=_model_config()))
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    hook(SimpleNamespace(model_config=_model_config()))
    with pytest.raises(p.DeepseekV4CpuError, match="bfloat16"):
        hook(SimpleNamespace(model_config=_model_config(dtype=torch.float32)))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.raises(p.DeepseekV4CpuError, match="AVX512-BF16"):
        hook(SimpleNamespace(model_config=_model_config()))
    hook(SimpleNamespace(model_config=_model_config("llama")))
    hook(SimpleNamespace(model_config=None))


# --- engines: the plugin loaded (LLM, then lm-eval's model), and not loaded --------------------

# Both engine scripts: the engine keyword arguments, the lightning indexer's top-k op counted,
# greedy generation with logprobs, and the settings the engine ran with.
_SETUP = """
import gc, os, sys, time
t0 = time.time()
from vllm import LLM, SamplingParams
import vllm._custom_ops as ops

res = {}
# (steps pinned to max_model_len on every host: a prompt is one step, alone or batched)
kw = dict(dtype="bfloat16", enforce_eager=True, max_model_len=ARGS["max_model_len"],
          max_num_batched_tokens=ARGS["max_model_len"], max_num_seqs=4, seed=0,
          kv_cache_memory_bytes=256 << 20, distributed_executor_backend="uni")
calls = [0]
topk_op = ops.topk_transform_512_cpu
def counted(*a, **k):
    calls[0] += 1
    return topk_op(*a, **k)
ops.topk_transform_512_cpu = counted
sp = SamplingParams(temperature=0.0, max_tokens=ARGS["max_tokens"], logprobs=5,
                    ignore_eos=True)

def gen(llm, prompts):
    t, c = time.time(), calls[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return dict(s=time.time() - t, topk_calls=calls[0] - c,
                tokens=[list(o.outputs[0].token_ids) for o in outs],
                logprobs=[[{int(k): v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs]
                          for o in outs])

def boot():
    t = time.time()
    llm = LLM(model=ARGS["model"], **kw)
    res["boot_s"] = time.time() - t
    from vllm.triton_utils import dispatcher
    res["registered"] = sorted(n for n, (_, impl) in dispatcher._registry.items()
                               if getattr(impl, "__module__", "").startswith("ulacache_vllm"))
    c = llm.llm_engine.vllm_config
    res["config"] = dict(
        block_size=c.cache_config.block_size, cache_dtype=str(c.cache_config.cache_dtype),
        prefix_caching=c.cache_config.enable_prefix_caching,
        num_blocks=c.cache_config.num_gpu_blocks,
        chunked_prefill=c.scheduler_config.enable_chunked_prefill,
        max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
        attention_backend=str(c.attention_config.backend))
    return llm

def loaded():
    # What of ulacache this process holds: its modules, and the hooks (__ulacache_patch__
    # names) on the functions and class attributes of every vLLM module loaded.
    import vllm.plugins
    res["plugins_loaded"] = vllm.plugins.plugins_loaded
    res["VLLM_PLUGINS"] = os.environ.get("VLLM_PLUGINS")
    res["ulacache_modules"] = sorted(m for m in sys.modules if m.startswith("ulacache_vllm"))
    # (Plain functions, classmethods and staticmethods only, read through their __dict__: a
    # module's lazy placeholders import on any attribute access.)
    import types
    hooks = set()
    def mark(v):
        if isinstance(v, (classmethod, staticmethod)):
            mark(v.__func__)
        if isinstance(v, (types.FunctionType, classmethod, staticmethod)):
            h = vars(v).get("__ulacache_patch__")
            if isinstance(h, str):
                hooks.add(h)
    for name, mod in list(sys.modules.items()):
        if not name.startswith("vllm") or not isinstance(mod, types.ModuleType):
            continue
        for v in list(vars(mod).values()):
            mark(v)
            if isinstance(v, type):
                for a in list(vars(v).values()):
                    mark(a)
    res["hooks"] = sorted(hooks)

short, long = ARGS["short"], ARGS["long"]
"""

ENGINE_SCRIPT = _SETUP + """
# 1. A CPU without AVX512-BF16: refused while the config is built, before any engine starts.
# (The patch's probe is mocked, not torch's: vLLM picks the kernel library it loads with
# torch's, and loading a second one aborts the process.)
from ulacache_vllm.patches import v4_cpu_isa
probe = v4_cpu_isa.host_has_avx512_bf16
v4_cpu_isa.host_has_avx512_bf16 = lambda: False
try:
    LLM(model=ARGS["model"], **kw)
    res["no_bf16"] = None
except Exception as e:
    res["no_bf16"] = [type(e).__name__, str(e)]
v4_cpu_isa.host_has_avx512_bf16 = probe
res["refusal_s"] = time.time() - t0

# 2. The real engine, ulacache's plugin loaded by vLLM as installed.
llm = boot()
res["short"] = gen(llm, short)
res["long"] = gen(llm, [long])
res["mixed"] = gen(llm, short + [long])
res["long_again"] = gen(llm, [long])
res["short_alone"] = [gen(llm, [p]) for p in short]  # as a server gets them, one by one
loaded()

# 3. lm-eval's `vllm` model (lm_eval.models.vllm_causallms.VLLM, which builds its own LLM) on
# the same model and engine settings, once the first engine is freed: greedy generate_until
# on the short prompts' text, then the loglikelihood of their greedy continuations.
del llm
gc.collect()
from vllm.distributed import cleanup_dist_env_and_memory
cleanup_dist_env_and_memory()
t = time.time()
from lm_eval.api.instance import Instance
from lm_eval.models.vllm_causallms import VLLM
lm = VLLM(pretrained=ARGS["model"], batch_size="auto", **kw)
ev = res["lm_eval"] = dict(boot_s=time.time() - t)
texts = ARGS["short_text"]
ev["encoded"] = lm.tok_encode(list(texts))
t = time.time()
ev["generate_until"] = lm.generate_until(
    [Instance("generate_until", {}, (x, {"until": [], "max_gen_toks": ARGS["max_tokens"],
                                         "do_sample": False}), i) for i, x in enumerate(texts)],
    disable_tqdm=True)
# Each prompt's longest greedy prefix whose text lm-eval tokenizes back into those tokens (a
# continuation's text can re-tokenize across the boundary differently).
ev["scored"] = []
for p, x, toks in zip(short, texts, res["short"]["tokens"]):
    k = max([k for k in range(1, len(toks) + 1)
             if lm.tok_encode(x + lm.tokenizer.decode(toks[:k])) == p + toks[:k]], default=0)
    ev["scored"].append(k)
ev["loglikelihood"] = [list(r) for r in lm.loglikelihood(
    [Instance("loglikelihood", {}, (x, lm.tokenizer.decode(toks[:k])), i)
     for i, (x, toks, k) in enumerate(zip(texts, res["short"]["tokens"], ev["scored"]))],
    disable_tqdm=True)]
ev["s"] = time.time() - t
res["total_s"] = time.time() - t0
emit(res)
"""

# The same generations with ulacache's plugin not loaded (VLLM_PLUGINS names every other
# general plugin), its import hook removed, and only V4's own fixes on this build applied by
# hand: without them V4 does not run here at all.
STOCK_SCRIPT = """
# ulacache's install also puts a .pth import hook in site-packages that patches vLLM's front
# end (LLM and EngineArgs keywords) as it is imported, plugins or not: taken out before vLLM is.
import sys
from ulacache_vllm.patches import import_hook
sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, import_hook._PostImportFinder)]
""" + _SETUP + """
from ulacache_vllm.patches import v4_cpu_isa, v4_tile_scheduler, v4_triton_fallbacks
for p in (v4_cpu_isa, v4_tile_scheduler, v4_triton_fallbacks):
    p.apply()
llm = boot()
res["short"] = gen(llm, short)
res["long"] = gen(llm, [long])
res["mixed"] = gen(llm, short + [long])
loaded()
res["total_s"] = time.time() - t0
emit(res)
"""
# On a host without AVX512-BF16 (where V4 cannot run at all): the real probe, unmocked, refuses
# V4 while the config is built, under either backend, before any engine starts.
REFUSED_SCRIPT = """
from vllm import LLM
res = {"refused": {}}
for backend in ("vllm", "ulacache"):
    try:
        LLM(model=ARGS["model"], dtype="bfloat16", enforce_eager=True,
            max_model_len=ARGS["max_model_len"], kv_backend=backend,
            kv_cache_memory_bytes=256 << 20)
        res["refused"][backend] = None
    except Exception as e:
        res["refused"][backend] = [type(e).__name__, str(e)]
emit(res)
"""

# What the stock run may import of ulacache: V4's three fixes, what they import, and the
# (removed) import hook its .pth file imports at interpreter start.
V4_FIX_HOOKS = ["v4_cpu_isa", "v4_tile_scheduler", "v4_triton_fallbacks"]
V4_FIX_MODULES = {"ulacache_vllm", "ulacache_vllm.patches", "ulacache_vllm.patches._hook",
                  "ulacache_vllm.patches.import_hook",
                  "ulacache_vllm.patches.v4_cpu_isa", "ulacache_vllm.patches.v4_tile_scheduler",
                  "ulacache_vllm.patches.v4_triton_fallbacks"}
STOCK_TEST = "test_stock_v4_output_identical_without_ulacache_loaded"
needs_v4_kernels = pytest.mark.skipif(not host_runs_v4(), reason=NO_V4_KERNELS)


def general_plugins_but_ulacache() -> str:
    """``VLLM_PLUGINS`` loading every installed ``vllm.general_plugins`` entry point but
    ulacache's (vLLM loads a general plugin only if its name is in the comma-separated list; an
    empty list parses to [""], which names none)."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "ulacache" in names, f"ulacache's entry point is not installed: {sorted(names)}"
    return ",".join(sorted(names - {"ulacache"}))


@pytest.fixture(scope="module")
def v4_prompts(tiny_model):
    from transformers import AutoTokenizer

    from ulacache_vllm.models.corpus import CORPUS

    tok = AutoTokenizer.from_pretrained(str(tiny_model(V4)))
    short = [tok(p)["input_ids"] for p in SHORT_PROMPTS]
    lines = CORPUS.splitlines()
    long = tok(" ".join(lines))["input_ids"] + tok(" ".join(reversed(lines)))["input_ids"]
    while len(long) < LONG_TOKENS:
        long += long
    return short, long[:LONG_TOKENS]


@pytest.fixture(scope="module")
def v4_runs(request, tiny_model, v4_prompts):
    """The plugin-loaded engine script and, when a selected test reads it, the stock one, side
    by side (one core each on a 2-core host: the same thread count for both, and greedy decoding
    does not depend on timing)."""
    short, long = v4_prompts
    args = dict(model=str(tiny_model(V4)), short=short, long=long, short_text=SHORT_PROMPTS,
                max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS)
    if not host_runs_v4():
        return [run_vllm_script(REFUSED_SCRIPT, args=args, timeout=600, env=dict(IN_PROCESS))]
    scripts = [(ENGINE_SCRIPT, {})]
    if STOCK_TEST in {item.originalname for item in request.session.items}:
        scripts.append((STOCK_SCRIPT, {"VLLM_PLUGINS": general_plugins_but_ulacache()}))

    def call(script, env):
        def run(bind):
            t = time.time()
            res = run_vllm_script(script, args=args, timeout=900, env={**env, **bind})
            res["script_s"] = time.time() - t
            return res
        return run

    runs = run_side_by_side(*(call(*x) for x in scripts), in_process=True)
    r = runs[0]
    print(f"\nV4 engine script: {r['script_s']:.1f} s (refusal at {r['refusal_s']:.1f} s, "
          f"boot {r['boot_s']:.1f} s, short {r['short']['s']:.1f} s, long "
          f"{r['long']['s']:.1f} s, mixed {r['mixed']['s']:.1f} s; lm-eval boot "
          f"{r['lm_eval']['boot_s']:.1f} s, requests {r['lm_eval']['s']:.1f} s)")
    if len(runs) > 1:
        print(f"V4 stock script (plugin not loaded): {runs[1]['script_s']:.1f} s")
    return runs


@pytest.fixture(scope="module")
def v4_run(v4_runs):
    return v4_runs[0]


@pytest.fixture(scope="module")
def v4_stock_run(v4_runs):
    assert len(v4_runs) == 2
    return v4_runs[1]


@pytest.mark.engine
def test_v4_refused_without_avx512_bf16(v4_run):
    """On a host with AVX512-BF16, the probe mocked in the engine script; on one without, the
    real probe: `LLM(...)` with either backend is refused naming the requirement."""
    if host_runs_v4():
        refused = {"mocked probe": v4_run["no_bf16"]}
    else:
        refused = v4_run["refused"]
        assert set(refused) == {"vllm", "ulacache"}, refused
    for backend, got in refused.items():
        assert got is not None, f"{backend}: V4 was not refused"
        kind, msg = got
        assert "AVX512-BF16" in msg and "DeepSeek-V4" in msg, (backend, kind, msg)


BATCH_TOL = 0.05  # nats: the same prompts alone and batched (see the test below)
SPIKE_TOL, MAX_SPIKES = 1.0, 2  # ... but for this many single steps (a routing near-tie)


def _batch_compare(alone: dict, together: dict, tol: float = BATCH_TOL,
                   spike_tol: float = SPIKE_TOL, max_spikes: int = MAX_SPIKES):
    """Two runs of the same prompts (greedy tokens, top-5 logprobs per step): along each
    prompt's steps, every logprob both runs returned within ``tol``, but at up to
    ``max_spikes`` steps in all within ``spike_tol`` (bf16 noise can flip one MoE routing
    choice where a position's k-th and (k+1)-th experts nearly tie: one step moves by up to
    ~0.6 nats, see ``_v4_reference``; a batching fault moves many); the tokens equal, or, at
    the step they part, a near tie in both runs (the two tokens within 2 x ``tol`` in each,
    at a spike step too), after which that prompt's histories differ and are not compared.
    Logprob keys may be token ids or their strings (the scripts' JSON). Returns (largest
    difference, near-tie partings, spike steps, problems)."""
    worst, flips, spikes, problems = 0.0, 0, [], []
    assert len(alone["tokens"]) == len(together["tokens"])
    for i, (ta, la, tb, lb) in enumerate(zip(alone["tokens"], alone["logprobs"],
                                             together["tokens"], together["logprobs"])):
        assert len(ta) == len(tb), (i, len(ta), len(tb))
        for step, (x, y, da, db) in enumerate(zip(ta, tb, la, lb)):
            da, db = ({int(k): v for k, v in d_.items()} for d_ in (da, db))
            d = max((abs(da[k] - db[k]) for k in da.keys() & db.keys()), default=0.0)
            worst = max(worst, d)
            if d > tol:
                if d <= spike_tol and len(spikes) < max_spikes:
                    spikes.append((i, step, round(d, 4)))
                else:
                    problems.append(f"prompt {i} step {step}: logprobs {d:.4f} apart alone "
                                    f"and batched (> {tol}; spikes so far {spikes})")
            if x != y:
                # (at an ordinary step the logprob bound implies it if both runs name both
                # tokens; it adds that they do, and holds a spike step's parting to a near tie)
                gap = max(da[x] - da.get(y, float("-inf")), db[y] - db.get(x, float("-inf")))
                if gap <= 2 * tol:
                    flips += 1
                else:
                    problems.append(f"prompt {i} step {step}: token {x} alone, {y} batched, "
                                    f"{gap:.4f} nats apart (not a near tie)")
                break
    return worst, flips, spikes, problems


def test_batch_compare_tells_noise_from_a_fault():
    one = {"tokens": [[5, 6, 7]], "logprobs": [[{5: -0.1, 9: -2.0}, {6: -0.5, 8: -0.52},
                                                 {7: -1.0}]]}
    noisy = {"tokens": [[5, 8, 1]], "logprobs": [[{5: -0.12, 9: -2.01}, {8: -0.49, 6: -0.51},
                                                   {1: -3.0}]]}
    worst, flips, spikes, problems = _batch_compare(one, noisy)
    assert (round(worst, 4), flips, spikes, problems) == (0.03, 1, [], [])  # a near tie
    as_json = [json.loads(json.dumps(r)) for r in (one, noisy)]  # (the scripts' string keys)
    assert _batch_compare(*as_json)[:3] == (worst, 1, [])
    # A parting at a spike step: x ahead by 0.4 in one run is no near tie.
    parted = {"tokens": [[5, 8, 7]], "logprobs": [[{5: -0.1, 9: -2.0}, {8: -0.3, 6: -0.7},
                                                    {7: -1.0}]]}
    assert len(_batch_compare(one, parted)[3]) == 1
    spiky = {"tokens": [[5, 6, 7]], "logprobs": [[{5: -0.1, 9: -2.0}, {6: -0.9, 8: -0.52},
                                                   {7: -1.01}]]}
    assert _batch_compare(one, spiky)[1:] == (0, [(0, 1, 0.4)], [])  # one routing spike
    assert len(_batch_compare(one, spiky, max_spikes=0)[3]) == 1
    wrong = {"tokens": [[5, 9, 7]], "logprobs": [[{5: -0.1, 9: -2.0}, {9: -0.2, 6: -1.9},
                                                   {7: -1.0}]]}
    worst, flips, spikes, problems = _batch_compare(one, wrong)
    assert flips == 0 and spikes == [] and len(problems) == 2
    assert worst == pytest.approx(1.4)
    far = {"tokens": [[5, 6, 7]], "logprobs": [[{5: -0.3, 9: -2.3}, {6: -0.8, 8: -0.9},
                                                 {7: -1.3}]]}
    spikes, problems = _batch_compare(one, far)[2:]  # every step off: two spikes, then a fault
    assert len(spikes) == 2 and len(problems) == 1 and "prompt 0 step 2" in problems[0]


@pytest.mark.engine
@needs_v4_kernels
def test_stock_v4_serves_with_ulacache_installed(v4_run, v4_prompts):
    from ulacache_vllm.patches.v4_triton_fallbacks import KERNELS

    short, long = v4_prompts
    assert len(long) > 2048
    assert set(v4_run["registered"]) >= set(KERNELS)
    s, lg, mixed = v4_run["short"], v4_run["long"], v4_run["mixed"]
    for toks in mixed["tokens"]:
        assert len(toks) == MAX_TOKENS
    # Prompt-dependent (random weights that are not dummy ones) and deterministic: the long
    # prompt again (its prefix now cached) gives the same tokens and logprobs, bit for bit.
    assert len({tuple(t) for t in mixed["tokens"]}) == len(mixed["tokens"])
    assert v4_run["long_again"]["tokens"] == lg["tokens"]
    assert v4_run["long_again"]["logprobs"] == lg["logprobs"]
    # Batch-invariant: the same tokens alone and batched, logprobs equal to bf16 noise. Not
    # bit for bit: the linear layers' GEMMs round differently for the batch's shapes, by host
    # (measured: short prompts equal and the long one within 3e-4 on AMX; 0.016 through the
    # lab's emulated kernels on an AVX2 host). A batching fault moves logprobs by nats.
    alone = {k: s[k] + lg[k] for k in ("tokens", "logprobs")}
    diff, flips, spikes, problems = _batch_compare(alone, mixed)
    print(f"\nbatched vs alone: max |dlogprob| {diff:.2e}, near-tie partings {flips}, "
          f"routing spikes {spikes}")
    assert not problems, "\n".join(problems)
    assert flips <= 1, flips  # (a near tie in one prompt's greedy path, not in several)
    # The real lightning indexer ran for the long prompt (its ops were reached: no plugin
    # hook replaced V4's indexer), and not for the short ones (every entry selected).
    assert s["topk_calls"] == 0
    assert lg["topk_calls"] > 0 and mixed["topk_calls"] > 0


def test_reference_first_token_routing_flips(tiny_model, v4_prompts):
    """The reference's routing-flip variants (``_v4_reference.first_token_variants``): each
    really flips a choice (its first-token row differs), and ``compare`` accepts a first token
    off the plain reference only when one variant matches it within the tolerance."""
    import torch

    import _v4_reference as ref

    model = ref.load(tiny_model(V4))
    prompt = v4_prompts[0][0]
    lp, _ = ref.teacher_forced(model, prompt, [0])
    # (at the last position: a flip elsewhere in the last MoE layer reaches no later token)
    variants = list(ref.first_token_variants(model, prompt, near=float("inf"), positions=1))
    assert 1 <= len(variants) <= ref.MAX_FLIPS and model._router_flip is None
    assert len({label[:2] for label, _ in variants}) == len(variants)
    for label, row in variants:
        assert label[1] == len(prompt) - 1 and not torch.equal(row, lp[0]), label
    assert torch.equal(ref.teacher_forced(model, prompt, [0])[0], lp)  # no flip left behind

    g = torch.Generator().manual_seed(0)
    plain = torch.log_softmax(torch.randn(1, 64, generator=g), -1)
    top5 = plain[0].topk(5).indices.tolist()
    flipped = plain[0].clone()
    flipped[top5] += 0.3
    got = [{t: float(flipped[t]) for t in top5}]
    toks = [top5[0]]
    assert len(ref.compare(plain, toks, got).problems) == 5
    c = ref.compare(plain, toks, got, first_token_variants=[(("a",), plain[0] + 0.5),
                                                            (("b",), flipped)])
    assert c.problems == [] and c.first_token_flip == ("b",)
    c = ref.compare(plain, toks, got, first_token_variants=[(("a",), plain[0] + 0.5)])
    assert len(c.problems) == 5 and c.first_token_flip is None


@pytest.mark.engine
@needs_v4_kernels
def test_v4_agrees_with_transformers_reference(v4_run, v4_prompts, tiny_model):
    import _v4_reference as ref

    short, long = v4_prompts
    model = ref.load(tiny_model(V4))
    report, failures = [], []
    for prompt, toks, lps in zip(short + [long], v4_run["mixed"]["tokens"],
                                 v4_run["mixed"]["logprobs"]):
        lp, gaps = ref.teacher_forced(model, prompt, toks)
        c = ref.compare(lp, toks, [{int(k): v for k, v in d.items()} for d in lps], gaps,
                        first_token_variants=ref.first_token_variants(model, prompt))
        report.append((len(prompt), round(c.first_token_max_diff, 4), round(c.step_max_diff, 4),
                       c.greedy_mismatches, c.routing_ties, round(c.routing_tie_max_diff, 4),
                       c.first_token_flip))
        failures += [f"prompt of {len(prompt)} tokens: {p}" for p in c.problems]
    print("\n(prompt tokens, first-token max |dlogprob|, any-step max, greedy near-tie flips, "
          "routing-tie steps, their max, the routing flip the first token matched):", report)
    assert not failures, "\n".join(failures)


@pytest.mark.engine
@needs_v4_kernels
def test_stock_v4_output_identical_without_ulacache_loaded(v4_run, v4_stock_run):
    """Issue 43's criterion: stock V4's greedy output is identical whether or not ulacache's
    other patches are loaded. The comparison run loads none of them (the plugin left out by
    VLLM_PLUGINS, the .pth import hook removed) and applies V4's three fixes by hand; the rest
    of the script is the same."""
    stock = v4_stock_run
    # The plugin-loaded run holds ulacache's patches; the stock run V4's fixes only.
    assert "ulacache_vllm.engine.plugin" in v4_run["ulacache_modules"]
    assert {"llm_kwargs", "engine_args", "engine_config", "cpu_sparse_attention",
            "cpu_mla_path"} <= set(v4_run["hooks"]), v4_run["hooks"]
    assert set(V4_FIX_HOOKS) <= set(v4_run["hooks"])
    assert stock["plugins_loaded"] and stock["VLLM_PLUGINS"] is not None
    assert "ulacache" not in stock["VLLM_PLUGINS"].split(",")
    assert set(stock["ulacache_modules"]) <= V4_FIX_MODULES, stock["ulacache_modules"]
    assert stock["hooks"] == V4_FIX_HOOKS, stock["hooks"]
    assert stock["registered"] == v4_run["registered"]
    # The engine was configured the same (block size, cache layout, schedule, KV blocks).
    assert stock["config"] == v4_run["config"]
    for k in ("short", "long", "mixed"):  # short and > 2048-token prompts, alone and batched
        assert stock[k]["tokens"] == v4_run[k]["tokens"], k
        assert stock[k]["logprobs"] == v4_run[k]["logprobs"], k  # bit for bit
        assert stock[k]["topk_calls"] == v4_run[k]["topk_calls"], k


@pytest.mark.engine
@needs_v4_kernels
def test_lm_eval_vllm_model_serves_stock_v4(v4_run, v4_prompts, tiny_model):
    """lm-eval's `vllm` model (its own LLM, the plugin loaded) on stock V4: generate_until gives
    the text of LLM's greedy tokens, and loglikelihood scores each prompt's greedy continuation
    (the longest prefix whose text re-tokenizes into the same tokens) as greedy, with the
    logprobs LLM sampled it with."""
    import math

    from transformers import AutoTokenizer

    short, _ = v4_prompts
    ev = v4_run["lm_eval"]
    assert ev["encoded"] == short  # lm-eval tokenizes the prompts as LLM got them
    tok = AutoTokenizer.from_pretrained(str(tiny_model(V4)))
    toks = v4_run["short"]["tokens"]
    for text, t in zip(ev["generate_until"], toks):
        # lm-eval stops at EOS (its `until`); LLM ran with ignore_eos.
        t = t[:t.index(tok.eos_token_id)] if tok.eos_token_id in t else t
        assert text == tok.decode(t, skip_special_tokens=False), (text, t)
    assert all(k >= 1 for k in ev["scored"]), ev["scored"]
    diffs = []
    for (ll, greedy), k, t, lps in zip(ev["loglikelihood"], ev["scored"], toks,
                                       v4_run["short"]["logprobs"]):
        expected = sum(step[str(x)] for step, x in zip(lps, t[:k]))
        # lm-eval scores by one prefill, LLM's logprobs come from decode steps: not greedy
        # only if LLM's own top two nearly tied at one of the scored steps (lm-eval says not
        # which; the shapes round differently by host); the sum is bounded below either way.
        margin = min(sorted(step.values())[-1] - sorted(step.values())[-2] for step in lps[:k])
        assert math.isfinite(ll) and (greedy is True or margin < 0.05), (ll, greedy, margin)
        diffs.append(abs(ll - expected) / k)
    print("\nlm-eval loglikelihood vs LLM's logprobs: tokens scored", ev["scored"],
          "max |diff| per token", max(diffs))
    assert max(diffs) < 2e-2, diffs


@pytest.mark.engine
def test_vllm_serve_serves_v4_with_either_backend(v4_run, v4_prompts, tiny_model, tmp_path):
    """`vllm serve` (the project's serve script, ulacache installed) serves the tiny V4 with the
    stock backend and with `--kv-backend ulacache` (the V4 line, issue 44), two servers side by
    side: greedy completions of the short prompts and the 2400-token one are LLM's tokens on
    both, and the ulacache server exports its `vllm:ulacache_*` series. On a host without
    AVX512-BF16, `vllm serve --kv-backend ulacache` exits at startup naming the requirement."""
    import subprocess

    import requests
    from test_serve import _free_port, _stop, _wait_healthy

    from _vllm_subprocess import vllm_env

    short, long = v4_prompts
    model = str(tiny_model(V4))
    repo = Path(__file__).resolve().parents[1]
    venv = Path(__import__("sys").executable).parent.parent
    args = ["--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "4", "--seed", "0",
            "--max-num-batched-tokens", str(MAX_MODEL_LEN)]  # (LLM's steps: ENGINE_SCRIPT)
    env = vllm_env(dict(VENV=str(venv), KV_CACHE_BYTES=str(256 << 20),
                        MAX_MODEL_LEN=str(MAX_MODEL_LEN)))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if not host_runs_v4():
        # No AVX512-BF16 here: the server exits at startup, its log naming the requirement.
        log = tmp_path / "serve_refused.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(["bash", str(repo / "scripts" / "serve.sh"), model,
                                     "ulacache", "127.0.0.1", str(_free_port()), *args],
                                    stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=repo)
        try:
            rc = proc.wait(timeout=300)
        finally:
            _stop(proc)
        text = log.read_text()
        assert rc != 0, text[-2000:]
        assert "AVX512-BF16" in text and "DeepSeek-V4" in text, text[-2000:]
        return
    servers = {}
    for backend in ("vllm", "ulacache"):
        port, log = _free_port(), tmp_path / f"serve_{backend}.log"
        with open(log, "w") as fh:
            proc = subprocess.Popen(["bash", str(repo / "scripts" / "serve.sh"), model, backend,
                                     "127.0.0.1", str(port), *args], stdout=fh,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    cwd=repo)
        servers[backend] = (proc, f"http://127.0.0.1:{port}", log)
    got, series = {}, []
    try:
        for backend, (proc, base, log) in servers.items():
            _wait_healthy(proc, base, log, time.time() + 600)
            got[backend] = []
            for p in [*short, long]:
                r = requests.post(base + "/v1/completions", timeout=300, json=dict(
                    model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                    ignore_eos=True, return_token_ids=True))
                assert r.status_code == 200, r.text
                got[backend].append(r.json()["choices"][0]["token_ids"])
        text = requests.get(servers["ulacache"][1] + "/metrics", timeout=60).text
        series = sorted({ln.split("{")[0].split(" ")[0] for ln in text.splitlines()
                         if ln.startswith("vllm:ulacache_")})
    finally:
        for proc, _, _ in servers.values():
            _stop(proc)
    # Each prompt was sent alone, as LLM ran it in `short_alone` and `long` (the same steps:
    # GEMMs round by their shapes, so a batch of three is not the reference here).
    want = [*(r["tokens"][0] for r in v4_run["short_alone"]), v4_run["long"]["tokens"][0]]
    assert got["vllm"] == want and got["ulacache"] == want
    assert "vllm:ulacache_arena_used_bytes" in series and len(series) >= 10, series
    # The CSA rows' tiers (the long prompt's rows were placed on the device pool).
    assert "vllm:ulacache_v4_csa_assigned_total" in series, series
    assert "vllm:ulacache_v4_csa_device_rows_used" in series, series
