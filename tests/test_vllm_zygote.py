"""The suite's pre-imported vLLM interpreter (``tests/_vllm_zygote.py``): which script
environments it takes, and that a script it forks runs as in a fresh interpreter (main module,
arguments, directory, environment, OpenMP share, output, return codes)."""
from __future__ import annotations

import os

import pytest

import _vllm_subprocess as vs
from _vllm_zygote import Zygote


def _bare(env: dict[str, str]) -> Zygote:
    z = Zygote.__new__(Zygote)  # (no process: ``accepts`` reads only these)
    z.env, z.imported, z._ready = dict(env), {"KMP_INIT_AT_FORK": "FALSE"}, True
    return z


def test_accepts_only_differences_read_when_used():
    base = {"PATH": "/bin", "PYTHONPATH": "/repo", "VLLM_LOGGING_LEVEL": "WARNING"}
    z = _bare(base)
    assert z.accepts(dict(base))
    assert z.accepts({**base, **vs.IN_PROCESS, "ULACACHE_PBLRU_SMALL_POOL_SLOTS": "0",
                      "ULACACHE_SCRIPT_ARGS": "{}", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    # Read at start-up or import: a fresh interpreter.
    for k, v in [("PYTHONPATH", "/other"), ("VLLM_LOGGING_LEVEL", "INFO"),
                 ("VLLM_PLUGINS", "none"), ("ULACACHE_LAB_V4_OPS", "1"), ("LD_PRELOAD", "x")]:
        assert not z.accepts({**base, k: v}), k
    assert not z.accepts({k: v for k, v in base.items() if k != "PYTHONPATH"})
    # A key vLLM's import sets, in the test process too where it imported vLLM: accepted with
    # the value that import leaves (a fresh interpreter ends with it either way), not another.
    assert z.accepts({**base, "KMP_INIT_AT_FORK": "FALSE"})
    assert not z.accepts({**base, "KMP_INIT_AT_FORK": "TRUE"})
    assert z.accepts({**base, "PYTEST_CURRENT_TEST": "tests/x.py::t (call)"})
    # GNU OpenMP's settings: one bound place, applied by the child, when the zygote has none.
    share = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}
    assert z.accepts({**base, **share})
    assert not z.accepts({**base, **share, "OMP_PLACES": "{0},{1}"})
    assert not z.accepts({**base, **share, "OMP_PROC_BIND": "close"})
    assert not z.accepts({**base, **share, "OMP_NUM_THREADS": "4,2"})
    assert not z.accepts({**base, "OMP_PROC_BIND": "true"})  # (not the whole triple)
    assert not _bare({**base, "OMP_NUM_THREADS": "2"}).accepts({**base, **share})
    assert _bare({**base, **share}).accepts({**base, **share})


SCRIPT = r"""
import os, sys, torch
print("to stdout"); print("to stderr", file=sys.stderr)
emit({"argv": sys.argv, "main": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
      "env": {k: os.environ.get(k) for k in ARGS["keys"]},
      "cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
      "vllm_loaded": "vllm" in sys.modules})
if ARGS["exit"] == "raise":
    raise ValueError("from the script")
if ARGS["exit"] == "kill":
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(ARGS["exit"])
"""


@pytest.mark.engine  # (starts the zygote, a vLLM import, when no engine test did)
def test_a_forked_script_runs_as_a_fresh_interpreter(tmp_path):
    zygote = vs._zygote()
    if zygote is None:
        pytest.skip(f"{vs.ZYGOTE_ENV}=0: every script runs in a fresh interpreter")
    cpus = sorted(os.sched_getaffinity(0))
    share = {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{%d}" % cpus[-1], "OMP_PROC_BIND": "true"}
    env = {**vs.IN_PROCESS, "ULACACHE_PBLRU_SMALL_POOL_SLOTS": "7"}
    if "OMP_PLACES" not in zygote.env:
        env.update(share)
    keys = sorted({*env, "PYTORCH_NVML_BASED_CUDA_CHECK", vs.ZYGOTE_ENV})
    assert not zygote.refusal(vs.vllm_env(env))
    res = vs.run_vllm_script(SCRIPT, args={"keys": keys, "exit": 0}, env=env,
                             boots_engine=False)
    assert res["main"] == "__main__" and res["argv"][0].endswith("script.py")
    assert res["cwd"] == os.path.dirname(res["argv"][0]) == res["path0"]
    assert res["vllm_loaded"]  # forked after the import (a fresh script has not imported it)
    for k in env:
        assert res["env"][k] == env[k], k
    # A key vLLM's import sets is there, as in a fresh interpreter that imported vLLM.
    assert res["env"]["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    if "OMP_PLACES" not in zygote.env:
        assert res["cpus"] == [cpus[-1]] and res["threads"] == 1, res
    # Return codes and output as subprocess gives them.
    for exit_, code, needle in [(3, 3, "to stderr"), ("raise", 1, "ValueError: from the script"),
                                ("kill", -9, "to stderr")]:
        with pytest.raises(vs.VllmScriptError) as err:
            vs.run_vllm_script(SCRIPT.replace("emit(", "print("),
                               args={"keys": keys, "exit": exit_}, env=env, boots_engine=False)
        assert f"exited {code} " in str(err.value) and "to stdout" in str(err.value), exit_
        assert needle in str(err.value), exit_
