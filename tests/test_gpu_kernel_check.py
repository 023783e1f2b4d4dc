"""``scripts/gpu_kernel_check.py --device cpu --quick`` keeps working: run in a subprocess (the
Triton interpreter set in that subprocess's environment only, never in this process), its
JSON says every parity check passed, graph capture was skipped on the CPU (the same pipeline
ran eagerly, bit-equal to the eager reference), and it imported no vLLM."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_on_cpu(script: str, tmp_path, out):
    """Runs ``scripts/<script> --device cpu --quick --out OUT`` in a subprocess (the Triton
    interpreter set in its environment only); asserts exit 0 and that it imported no vLLM."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("ULACACHE_FORCE_TRITON", None)
    # The script's own exit status, plus whether anything it imported pulled in vLLM.
    proc = subprocess.run(
        [sys.executable, "-c",
         "import atexit, sys, runpy\n"
         "atexit.register(lambda: print('VLLM_IMPORTED', 'vllm' in sys.modules))\n"
         "sys.argv = sys.argv[1:]\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n",
         str(REPO / "scripts" / script), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "VLLM_IMPORTED False" in proc.stdout, log


def test_gpu_kernel_check_on_cpu(tmp_path):
    before = os.environ.get("TRITON_INTERPRET")
    out = tmp_path / "check.json"
    _run_on_cpu("gpu_kernel_check.py", tmp_path, out)
    d = json.loads(out.read_text())
    assert d["env"]["device"] == "cpu" and d["env"]["triton_interpret"] == "1"
    names = [c["name"] for c in d["parity"]]
    failed = [c for c in d["parity"] if not c["ok"]]
    assert d["parity_ok"] and not failed, failed
    for want in ("resolve+stage row=656", "resolve+stage row=1152", "identity",
                 "staging_overflow", "write_translate", "label_hit_touch",
                 "uva: stage kernel", "graph T="):
        assert any(want in n for n in names), (want, names)
    g = d["graphs"]
    assert "skipped" in g["mode"] and g["ok"]
    assert any("graph capture skipped on cpu" in n for n in d["notes"])
    assert all(r["replays"] >= 2 and r["misses"] > 0 and r["promotions"] > 0
               and r["identity_replay"] for r in g["runs"])
    assert any("settle ensure_resident" in k for k in d["timings"])
    assert d["ok"]
    assert os.environ.get("TRITON_INTERPRET") == before  # set in the subprocess only


def test_gpu_runtime_check_on_cpu(tmp_path):
    """``scripts/gpu_runtime_check.py --device cpu --quick``: the CUDA glue's `CudaRows` step
    contract in a serving loop reads back every selected row's bytes, with demotions,
    promotions, staged host rows, chunked calls and frees all > 0, and without vLLM."""
    out = tmp_path / "runtime.json"
    _run_on_cpu("gpu_runtime_check.py", tmp_path, out)
    d = json.loads(out.read_text())
    assert d["ok"] and {r["row_bytes"] for r in d["runs"]} == {656, 1152}
    for r in d["runs"]:
        c = r["counters"]
        assert r["reads"] > 0 and r["bad_reads"] == 0, r
        assert min(c["promotions"], c["demotions"], c["staged"], c["chunked_calls"],
                   r["freed_blocks"]) > 0 and c["overflow"] == 0, r
        assert c["merged_plans"] > 0, r  # settles and writes moved as one plan
