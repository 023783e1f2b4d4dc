"""Run a vLLM script in a fresh subprocess with a timeout and get a JSON result back.

vLLM engines are slow to start (~15 s on CPU), spawn worker processes and keep global
state, so tests run each engine in its own interpreter: one engine per script, reused for
several generate calls inside it. Most of that start is importing vLLM: a script whose
environment allows it is forked from a pre-imported interpreter (``tests/_vllm_zygote.py``)
instead of starting a fresh one; it runs the same way either way. The script calls
``emit(obj)`` (defined by the prelude) to return a JSON-serialisable result;
``run_vllm_script`` returns it.

    res = run_vllm_script('''
    from vllm import LLM
    llm = LLM(model=ARGS["model"], ...)
    emit({"ok": True})
    ''', args={"model": str(path)})
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MARK = "@@ULACACHE_RESULT@@"
REPO_ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = f"""\
import json as _json, os as _os, sys as _sys
ARGS = _json.loads(_os.environ.get("ULACACHE_SCRIPT_ARGS", "{{}}"))
def emit(obj):
    _sys.stdout.write("\\n{_MARK}" + _json.dumps(obj) + "\\n")
    _sys.stdout.flush()
"""


class VllmScriptError(AssertionError):
    """The script failed, timed out, or emitted nothing; the message carries its output."""


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def vllm_env(extra: dict[str, str] | None = None,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a vLLM CPU subprocess.

    VLLM_CPU_KVCACHE_SPACE is dropped: it conflicts with kv_cache_memory_bytes (an empty
    value even crashes). The repo root goes on PYTHONPATH so an uninstalled checkout works.
    """
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # Test-process flags that must not reach an engine (the kernel tests run Triton's
    # interpreter; engines never do).
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if extra:
        env.update(extra)
    return env


# Set by conftest for each test: whether it carries the ``engine`` marker. A script that boots
# an engine from an unmarked test is refused, so ``pytest -m "not engine"`` never boots one.
ENGINE_MARKED: bool | None = None


def require_engine_marker() -> None:
    """Called by every helper that boots vLLM (scripts, servers)."""
    if ENGINE_MARKED is False:
        raise AssertionError("this test boots a vLLM engine: mark it @pytest.mark.engine")


def run_vllm_script(code: str, *, args: dict[str, Any] | None = None, timeout: float = 600,
                    env: dict[str, str] | None = None, boots_engine: bool = True) -> Any:
    """Run ``code`` (a script body; it may define functions) under ``__main__`` in a new
    interpreter and return what it passed to ``emit``. ``args`` reach it as ``ARGS``.

    The body is wrapped in ``if __name__ == "__main__":`` by being written to a file and
    run as the main module: vLLM's spawned workers re-import the main module, and the
    guard keeps them from running the body again.

    A script emits once, at its end: the call returns as soon as the result is out, and the
    process shuts its engine down in the background (``_SHUTTING_DOWN``; most of a vLLM
    shutdown is waiting: ~5 s for the engine core to see its worker exit, then the client's
    forced kill), overlapping whatever the test does next. A script that exits without a
    result, or with an error before emitting one, fails as before. On timeout (or an
    interrupt) the script is killed with every process it started.
    """
    if boots_engine:
        require_engine_marker()
    _reap_shut_down()
    body = textwrap.dedent(code)
    script = _PRELUDE + "\n\ndef _main():\n" + textwrap.indent(body, "    ") + \
        "\n\nif __name__ == '__main__':\n    _main()\n"
    full_env = vllm_env(env)
    full_env["ULACACHE_SCRIPT_ARGS"] = json.dumps(args or {})
    td = tempfile.TemporaryDirectory(prefix="ulacache_vllm_script_")
    root = Path(td.name)
    (root / "script.py").write_text(script)
    out_path, err_path = root / "stdout", root / "stderr"
    try:
        zygote = _zygote()
        proc, refused = None, ["(no zygote)"]
        if zygote is not None:
            try:
                refused = zygote.refusal(full_env)
                if not refused:
                    proc = zygote.spawn(root / "script.py", full_env, root, out_path, err_path)
                    SCRIPTS["forked"] += 1
            except (OSError, RuntimeError, ValueError) as e:  # (it is out of use now)
                warnings.warn(f"the vLLM zygote failed ({e!r}): fresh interpreters from now")
                refused = ["(zygote failed)"]
        if proc is None:
            SCRIPTS["fresh"] += 1
            SCRIPTS["fresh_keys"].update(refused)
            with open(out_path, "w") as fo, open(err_path, "w") as fe:
                proc = subprocess.Popen([sys.executable, str(root / "script.py")], stdout=fo,
                                        stderr=fe, env=full_env, cwd=root)
    except BaseException:
        td.cleanup()
        raise
    try:
        result = _wait_for_result(proc, out_path, timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = _read(out_path), _read(err_path)
        td.cleanup()
        raise VllmScriptError(f"vLLM script timed out after {timeout}s\n"
                              f"--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}")
    except BaseException:  # interrupted: take the engine down with the test
        _kill_tree(proc)
        td.cleanup()
        raise
    if result is not None and proc.poll() is None:
        with _SHUT_LOCK:
            _SHUTTING_DOWN.append((proc, td, time.monotonic()))
        return json.loads(result)
    out, err = _read(out_path), _read(err_path)
    td.cleanup()
    results = [line[len(_MARK):] for line in out.splitlines() if line.startswith(_MARK)]
    if results and proc.returncode == -signal.SIGABRT and "terminate called" in err:
        # The script finished and emitted its result; vLLM's CPU engine then occasionally
        # aborts in a C++ thread destructor while the interpreter shuts down (seen about once
        # in ten CI runs, stock backend included). That is not what the tests measure.
        warnings.warn("vLLM script aborted at shutdown after emitting its result")
        return json.loads(results[-1])
    if proc.returncode != 0 or not results:
        raise VllmScriptError(
            f"vLLM script exited {proc.returncode} with {len(results)} results\n"
            f"--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}")
    return json.loads(results[-1])


# Scripts that emitted their result and are still shutting their engine down: (process, its
# temporary directory, when it was left). Reaped by later calls and at exit; one still running
# SHUTDOWN_GRACE_S after it was left is killed with the processes it started.
_SHUTTING_DOWN: list[tuple[subprocess.Popen, Any, float]] = []
_SHUT_LOCK = threading.Lock()
SHUTDOWN_GRACE_S = 60.0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill the script and every process it started (vLLM's engine core and workers)."""
    try:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - gone already, or no psutil: vLLM's children watch
        kids = []      # their parent and exit with it
    if proc.poll() is None:
        proc.kill()
    for k in kids:
        try:
            k.kill()
        except Exception:  # noqa: BLE001 - exited meanwhile
            pass
    proc.wait()


def _wait_for_result(proc: subprocess.Popen, out_path: Path, timeout: float) -> str | None:
    """Poll until the script exits or its stdout holds a complete result line; returns that
    line's JSON (None: exited without one). Raises subprocess.TimeoutExpired."""
    deadline = time.monotonic() + timeout
    mark = _MARK.encode()
    seen, buf = 0, b""
    while True:
        done = proc.poll() is not None
        with open(out_path, "rb") as f:
            f.seek(seen)
            chunk = f.read()
        seen += len(chunk)
        *lines, buf = (buf + chunk).split(b"\n")  # an incomplete last line waits for more
        for line in lines:
            if line.startswith(mark):
                return line[len(mark):].decode()
        if done:
            return None
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.1)


def _reap_shut_down(wait: bool = False) -> None:
    """Forget the scripts that finished shutting down; kill those past SHUTDOWN_GRACE_S (with
    ``wait``: wait for each up to its grace first, as at exit)."""
    with _SHUT_LOCK:
        left = list(_SHUTTING_DOWN)
        _SHUTTING_DOWN.clear()
    keep = []
    for proc, td, since in left:
        over = since + SHUTDOWN_GRACE_S - time.monotonic()
        if proc.poll() is None and wait:
            try:
                proc.wait(timeout=max(0.0, over))
            except subprocess.TimeoutExpired:
                pass
        killed = proc.poll() is None and (wait or over <= 0)
        if killed:
            _kill_tree(proc)
        if proc.poll() is None:
            keep.append((proc, td, since))
            continue
        _warn_unclean_exit(proc, Path(td.name) / "stderr", killed)
        td.cleanup()
    with _SHUT_LOCK:
        _SHUTTING_DOWN.extend(keep)


def _warn_unclean_exit(proc: subprocess.Popen, err_path: Path, killed: bool) -> None:
    """A script that emitted its result and was left to shut down has ended: say so when that
    shutdown was not clean (killed after SHUTDOWN_GRACE_S, or a non-zero exit other than the
    known C++-destructor abort). Its test already has its result, so this warns (in pytest's
    warnings summary; on stderr at exit) rather than failing a later test."""
    if killed:
        msg = f"still shutting down {SHUTDOWN_GRACE_S:.0f} s after emitting its result; killed"
    elif proc.returncode == 0 or (proc.returncode == -signal.SIGABRT
                                  and "terminate called" in _read(err_path)):
        return
    else:
        msg = f"exited {proc.returncode} after emitting its result"
    warnings.warn(f"vLLM script {msg}\n--- stderr ---\n{_tail(_read(err_path), 2000)}")


# The pre-imported interpreter that forks scripts (``tests/_vllm_zygote.py``): started by
# ``start_zygote`` (conftest, once engine tests are collected) or by the first script; off with
# ULACACHE_TEST_ZYGOTE=0 (every script a fresh interpreter). One that died is not restarted:
# later scripts start fresh interpreters.
ZYGOTE_ENV = "ULACACHE_TEST_ZYGOTE"
# How this session's scripts started, and the keys that kept them from the zygote (pytest's
# summary).
SCRIPTS: dict[str, Any] = {"forked": 0, "fresh": 0, "fresh_keys": Counter()}
_ZYGOTE: Any = None
_ZYGOTE_LOCK = threading.Lock()


def start_zygote(base_env: dict[str, str] | None = None) -> None:
    """Start it now, with ``base_env`` for this process's environment (conftest: the session's,
    which every test starts with, whatever collecting the tests imported)."""
    _zygote(base_env)


def _zygote(base_env: dict[str, str] | None = None):
    global _ZYGOTE
    if os.environ.get(ZYGOTE_ENV, "1") == "0":
        return None
    with _ZYGOTE_LOCK:
        if _ZYGOTE is None:
            from _vllm_zygote import Zygote

            _ZYGOTE = Zygote(vllm_env(base=base_env))
        if _ZYGOTE.dead():
            return None
        return _ZYGOTE


def _at_exit() -> None:
    _reap_shut_down(True)  # (the zygote's children among them)
    if _ZYGOTE is not None:
        _ZYGOTE.close()


atexit.register(_at_exit)


# The engine core in the script's own process (vLLM's uni-process executor: the worker there
# too). One interpreter importing vLLM instead of three (script, engine core, worker): on a
# slow 2-core host an import of vLLM takes 12-14 s, most of a tiny-model engine test. The
# scheduler still reaches the worker only through ``SchedulerOutput`` and ``collective_rpc``;
# what crosses a process boundary is tested where it must (``vllm serve``: always a core
# process; TP=2: workers in their own processes; the GPT-OSS arena run). An in-process core
# steps only when the client asks: a script reading its pools after ``generate`` takes one
# empty step first (``IDLE_STEP``), which a core process takes by itself.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
IDLE_STEP = """
import os as _os
def idle_step():
    # The step that carries the last finished requests' frees to the worker: a core process
    # takes it by itself; an in-process one only when asked.
    if _os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        llm.llm_engine.step()
"""


def run_side_by_side(*calls: Callable[[dict[str, str]], Any],
                     in_process: bool = False) -> list[Any]:
    """Run independent single-rank engine runs at the same time; return their results in
    order. Each call gets the environment entries to add to its engine's (``env=`` of
    ``run_vllm_script``): its own share of this process's CPUs for its compute threads, the
    same number for every call (``side_by_side_binds``). Every call runs to its end; then the
    first error, if any, is raised. With fewer CPUs than calls they run one after another,
    unpinned. ``in_process``: each engine's core runs in its script's process (``IN_PROCESS``).

    A tiny-model engine process is mostly start-up and shutdown (imports, engine-core and
    worker spawns and their imports, worker teardown: ~40 s of a ~50 s run), nearly all on
    one core, and vLLM's automatic binding puts every single-rank engine's compute threads
    on the same first core (on a 2-core host: one thread on core 0 for each). Disjoint
    shares keep the compute apart too (2 cores: one thread on core 0, one on core 1, as
    many threads as the automatic binding there). Greedy decoding does not depend on timing,
    and runs compared with each other get the same number of threads.
    """
    binds = side_by_side_binds(len(calls), in_process=in_process)
    if binds is None:
        return [c(dict(IN_PROCESS) if in_process else {}) for c in calls]
    return run_at_once(*(lambda c=c, b=b: c(b) for c, b in zip(calls, binds)))


def run_at_once(*calls: Callable[[], Any]) -> list[Any]:
    """Run engine scripts at the same time (one thread each, waiting on its subprocess) and
    return their results in order; every call runs to its end, then the first error, if any,
    is raised. For TP engines compared with each other (``tp_omp_bind``: each engine's rank r
    on the same CPUs as the other's): their start-ups, a vLLM import per process on one core
    each, overlap, and their compute shares the cores. Greedy decoding does not depend on
    timing, and each engine's ranks keep their thread counts."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="vllm_script") as pool:
        futures = [pool.submit(c) for c in calls]
    return [f.result() for f in futures]


def side_by_side_binds(n: int, in_process: bool = False) -> list[dict[str, str]] | None:
    """``n`` environment entries giving ``n`` single-rank engines (scripts or servers) that
    run at the same time disjoint, equal shares of this process's CPUs for their compute
    threads; None with fewer CPUs than engines (or one engine): run them unpinned, one after
    another. An engine with a worker process takes its share as ``VLLM_CPU_OMP_THREADS_BIND``
    (vLLM turns it into the worker's OpenMP environment); an in-process one (``in_process``)
    gets that OpenMP environment itself, as vLLM's ``OMPProcessManager`` writes it for a
    worker (GNU OpenMP, torch's: thread count, one place of the share's CPUs, bound)."""
    cpus = sorted(os.sched_getaffinity(0))
    if n < 2 or len(cpus) < n:
        return None
    k = len(cpus) // n
    shares = [cpus[i * k:(i + 1) * k] for i in range(n)]
    if in_process:
        return [{**IN_PROCESS, "OMP_NUM_THREADS": str(len(share)),
                 "OMP_PLACES": "{" + ",".join(map(str, share)) + "}", "OMP_PROC_BIND": "true"}
                for share in shares]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, share))} for share in shares]


def tp_omp_bind(tp: int) -> dict[str, str]:
    """The environment entry binding a TP=``tp`` CPU engine's ranks to disjoint, equal shares
    of the CPUs this process may run on (``side_by_side_binds``' shares, one per rank, joined
    by "|" as ``VLLM_CPU_OMP_THREADS_BIND`` takes them). Each rank's OpenMP threads need cores
    of their own: with fewer usable CPUs than ranks this fails (AssertionError, naming the
    CPUs) rather than piling the ranks onto one core or skipping. ``tp`` 1: no entry (vLLM's
    automatic binding)."""
    if tp < 2:
        return {}
    binds = side_by_side_binds(tp)
    if binds is None:
        cpus = sorted(os.sched_getaffinity(0))
        raise AssertionError(
            f"a TP={tp} CPU engine binds each rank's threads to cores of its own, but this "
            f"process may run on {len(cpus)} CPU(s) only (os.sched_getaffinity: {cpus}); "
            f"give it at least {tp} (taskset, cgroup cpuset)")
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(b["VLLM_CPU_OMP_THREADS_BIND"] for b in binds)}


# Keyword arguments every tiny-model LLM needs on the CPU build.
BASE_LLM_KWARGS: dict[str, Any] = dict(
    enforce_eager=True,
    kv_cache_memory_bytes=256 << 20,
    max_model_len=1024,
    max_num_seqs=8,
    seed=0,
)
# vLLM's CPU rotary kernel mishandles MLA's 3-D query views (wrong, batch-dependent results);
# the native rotary path is correct.
MLA_LLM_KWARGS: dict[str, Any] = dict(compilation_config={"custom_ops": ["all", "-rotary_embedding"]})
# Dense MLA (DeepSeek-V3) on vLLM's reference CPU_MLA kernel on every host: on CPUs with AMX
# tiles vLLM would pick AMX_MLA, which refuses the float32 weights the HF comparisons use.
DENSE_MLA_LLM_KWARGS: dict[str, Any] = dict(MLA_LLM_KWARGS, attention_backend="CPU_MLA")


def host_has_amx() -> bool:
    """Whether vLLM's CPU build takes its AMX MLA path on this host (x86 with AMX tiles)."""
    import platform

    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and \
        bool(torch.cpu._is_amx_tile_supported())


def host_runs_v4() -> bool:
    """Whether vLLM's CPU build can run DeepSeek-V4 on this host: its kernels exist only in the
    library vLLM loads on x86 CPUs with AVX512-BF16 (the probe `patches/v4_cpu_isa` refuses V4
    by). On other x86 hosts (AVX2 only, or AVX-512 without BF16) V4 is refused at startup."""
    import platform

    from ulacache_vllm.patches.v4_cpu_isa import host_has_avx512_bf16

    return platform.machine().lower() not in ("x86_64", "amd64") or host_has_avx512_bf16()


# The reason a V4 engine test gives where the host cannot run V4 at all: there the engines'
# refusal is what is checked (test_deepseek_v4.py::test_v4_refused_without_avx512_bf16).
NO_V4_KERNELS = ("DeepSeek-V4's CPU kernels need AVX512-BF16, which this CPU lacks: its engines "
                 "are refused here (test_v4_refused_without_avx512_bf16 checks the refusal)")


# The two CPU MLA paths of vLLM's CPU build, as the scheduler and cache choices a DSA model
# gets by default on each kind of host (README, "CPU hosts"). Pinning them makes a test run the
# same schedule on every host; "host" leaves vLLM's defaults (whichever path this host takes).
#   amx:       chunked prefill and prefix caching on, block 128, max_num_batched_tokens left
#              to vLLM's default (LLM class 4096 x TP, server 2048 x TP).
#   reference: chunked prefill and prefix caching off, block 16,
#              max_num_batched_tokens = max(max_model_len, 2048).
MLA_PATHS = ("amx", "reference", "host")


def mla_path_kwargs(path: str, max_model_len: int = 1024) -> dict[str, Any]:
    if path == "amx":
        return dict(enable_chunked_prefill=True, enable_prefix_caching=True, block_size=128)
    if path == "reference":
        return dict(enable_chunked_prefill=False, enable_prefix_caching=False, block_size=16,
                    max_num_batched_tokens=max(max_model_len, 2048))
    if path == "host":
        return {}
    raise ValueError(f"unknown MLA path {path!r}; one of {MLA_PATHS}")


def host_mla_path() -> str:
    """The path vLLM picks by default for MLA on this host."""
    return "amx" if host_has_amx() else "reference"


# Script fragment (``llm``, ``prompts`` (8+), ``greedy(n)``, ``abort_tokens`` and ``res`` in
# scope): four requests stepped through the engine, "a0" and "a2" aborted mid-decode after the
# client's sixth step. The survivors "a1", "a3" ask for ``abort_tokens``; the aborted ones for
# ABORTED_MAX_TOKENS, far more than six steps make, so they cannot finish before the abort
# lands even when the engine core runs in its own process a step or two ahead of the client
# (every prompt here leaves room for them in max_model_len 1024). Records in ``res["abort"]``
# (checked by ``check_aborts``): what each request had when the abort was sent and at the end,
# every finished output's tokens and finish reason, and the core's running and waiting
# requests right after the loop (the gauges of the last step's scheduler stats: a request the
# client forgot but the core kept running shows there). ``res["abort_survivors"]``: the
# survivors' tokens by id.
ABORTED_MAX_TOKENS = 384
ABORT_TWO_OF_FOUR = """
eng = llm.llm_engine
abort_max = {f"a{i}": abort_tokens if i % 2 else @ABORTED_MAX_TOKENS@ for i in range(4)}
for i in range(4):
    eng.add_request(f"a{i}", prompts[i + 4], greedy(abort_max[f"a{i}"]))
done, seen, steps, at_abort = {}, {}, 0, None
while eng.has_unfinished_requests():
    for out in eng.step():
        seen[out.request_id] = len(out.outputs[0].token_ids)
        if out.finished:
            done[out.request_id] = [list(out.outputs[0].token_ids), out.outputs[0].finish_reason]
    steps += 1
    if steps == 6:
        at_abort = {k: seen.get(k, 0) for k in ("a0", "a2")}
        eng.abort_request(["a0", "a2"])
core = {}
for m in llm.get_metrics():
    if m.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        core[m.name] = core.get(m.name, 0) + m.value
res["abort"] = {"max_tokens": abort_max, "at_abort": at_abort, "seen": seen, "finished": done,
                "core_after": core}
res["abort_survivors"] = {k: v[0] for k, v in done.items() if k in ("a1", "a3")}
""".replace("@ABORTED_MAX_TOKENS@", str(ABORTED_MAX_TOKENS))


def check_aborts(run: dict[str, Any], ref: dict[str, Any] | None = None) -> None:
    """``ABORT_TWO_OF_FOUR``'s report: "a0" and "a2" were aborted mid-decode (tokens out when
    the abort was sent, fewer than they asked for at the end, never finished unless with
    finish_reason "abort"), the engine core dropped them too (nothing running or waiting once
    the survivors are done), "a1" and "a3" ran to their length; with ``ref``, the survivors'
    tokens equal the reference run's."""
    rep = run["abort"]
    assert rep["at_abort"] is not None, rep  # the loop reached the abort
    fin = {k: why for k, (_, why) in rep["finished"].items()}
    for k in ("a1", "a3"):
        assert fin.get(k) == "length", (k, fin)
        assert len(rep["finished"][k][0]) == rep["max_tokens"][k] == rep["seen"][k], (k, rep)
    for k in ("a0", "a2"):
        assert fin.get(k, "abort") == "abort", (k, fin)  # LLMEngine sends no final output
        assert 0 < rep["at_abort"][k] < rep["max_tokens"][k], (k, rep["at_abort"])
        assert rep["seen"][k] < rep["max_tokens"][k], (k, rep["seen"])
    assert rep["core_after"] == {"vllm:num_requests_running": 0,
                                 "vllm:num_requests_waiting": 0}, rep["core_after"]
    if ref is not None:
        assert run["abort_survivors"] == ref["abort_survivors"]
        assert set(ref["abort_survivors"]) == {"a1", "a3"}


# Speculative decoding with DeepSeek's MTP layer, drafts that agree often enough to be accepted
# and not always (both paths of the verify step: accepted drafts' rows kept, rejected ones'
# rewritten at the next step). The tiny model's MTP layer is built to agree with its target
# (the model factory's ``mtp_block_scale``: it mostly reproduces the target's last hidden state,
# so its draft is the target's last token again), and the prompts are each one word repeated,
# on which the random target repeats itself often but not always. Measured on the tiny
# DeepSeek-V3.2: ~20 % of the draft tokens accepted (the model's plain MTP layer on the earlier
# varied prompts: 3 of 746).
AGREEING_MTP = dict(num_nextn_predict_layers=1, mtp_block_scale=0.1)
# Script fragment: ``prompts``, eight prompts of one repeated word each, ``words_per_prompt``
# (a list of 8 ints) words long.
REPEATED_WORD_PROMPTS = """
_rep = "the during cache one and model page of".split()
prompts = [" ".join([_rep[i]] * n) for i, n in enumerate(words_per_prompt)]
"""
# Script fragment (``llm`` in scope): the speculative-decoding counters (vector ones as lists).
SPEC_DECODE_METRICS = """
spec_metrics = {x.name: getattr(x, "value", getattr(x, "values", None))
                for x in llm.get_metrics() if x.name.startswith("vllm:spec_decode_")}
"""
SPEC_DRAFTS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def check_drafts_judged_both_ways(m: dict[str, Any], ref: dict[str, Any]) -> None:
    """Speculative-decoding counters ``m`` against the stock run's ``ref``: drafts proposed,
    some accepted and some rejected (0 < accepted < drafted; not a rare agreement), and the
    same drafts judged alike: every counter equals stock's, draft position by position."""
    assert m["vllm:spec_decode_num_drafts"] > 0, m
    for k in ("vllm:spec_decode_num_drafts", SPEC_DRAFTS, SPEC_ACCEPTED,
              "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert m[k] == ref[k], (k, m, ref)
    assert m[SPEC_DRAFTS] > m[SPEC_ACCEPTED] > 0, m
    assert m[SPEC_ACCEPTED] >= m[SPEC_DRAFTS] // 20, m  # the agreeing MTP layer


# Script fragment ending a script (``llm``, ``res`` in scope): the ulacache, preemption and
# prefix-cache metrics into ``res["metrics"]``, then ``emit(res)``. (``vllm:prefix_cache_queries``
# counts the prompt tokens the engine core's scheduler looked up in its prefix cache: 0 when
# prefix caching is off in the running engine.)
EMIT_WITH_METRICS = """
metrics = {}
for m in llm.get_metrics():
    if m.name.startswith("vllm:ulacache_") or m.name in ("vllm:num_preemptions",
                                                       "vllm:prefix_cache_queries"):
        metrics[m.name] = getattr(m, "value", None)
res["metrics"] = metrics
emit(res)
"""

_GENERATE = """
from vllm import LLM, SamplingParams
llm = LLM(model=ARGS["model"], **ARGS["llm_kwargs"])
sp = SamplingParams(temperature=0.0, max_tokens=ARGS["max_tokens"], ignore_eos=True)
runs = []
for _ in range(ARGS["repeats"]):
    outs = llm.generate(ARGS["prompts"], sp, use_tqdm=False)
    runs.append([list(o.outputs[0].token_ids) for o in outs])
prompt_lens = [len(o.prompt_token_ids) for o in outs]
emit({"runs": runs, "prompt_lens": prompt_lens, "text": [o.outputs[0].text for o in outs]})
"""


def vllm_generate(model: str | os.PathLike, prompts: list[str], *, max_tokens: int = 16,
                  repeats: int = 2, llm_kwargs: dict[str, Any] | None = None,
                  mla: bool = False, dense_mla: bool = False, timeout: float = 600,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """Greedy-generate ``prompts`` ``repeats`` times with one engine in a subprocess.

    Returns ``{"runs": [[token ids per prompt] per repeat], "prompt_lens", "text"}``.
    """
    mla_kw = DENSE_MLA_LLM_KWARGS if dense_mla else MLA_LLM_KWARGS if mla else {}
    kw = {**BASE_LLM_KWARGS, **mla_kw, **(llm_kwargs or {})}
    return run_vllm_script(_GENERATE, args=dict(model=str(model), prompts=prompts,
                                                 max_tokens=max_tokens, repeats=repeats,
                                                 llm_kwargs=kw),
                           timeout=timeout, env=env)
