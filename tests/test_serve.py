"""Serve smoke test: `vllm serve <embedded tiny DSA model> --kv-backend ulacache` on
127.0.0.1 through the project's serve script, concurrent completions, `/metrics` counters.

A stock server (`--kv-backend vllm`, the same model, flags and greedy sampling) runs beside
it: the greedy texts of the pressure workloads (rows demoted to the host pool and promoted
back, read from `/metrics`) must be stock's, not just ulacache's own on another request."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from ulacache_vllm.engine.faults import ENV as FAULTS_ENV

pytestmark = pytest.mark.engine  # every test here boots vLLM

REPO = Path(__file__).resolve().parents[1]
# Every server here runs the reference MLA path's schedule on every host (block 16, no chunked
# prefill or prefix caching, 2048-token steps), the one the KV budgets below were set on: with
# AMX tiles vLLM would give the DSA model block 128, prefix caching and chunked prefill
# with a defaulted step, which ulacache lowers to what its device pool holds.
REFERENCE_PATH_FLAGS = ["--no-enable-chunked-prefill", "--no-enable-prefix-caching",
                        "--block-size", "16", "--max-num-batched-tokens", "2048"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str) -> float:
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


# The stock reference servers' KV budget: far above what any workload here holds (no
# preemption, no pressure), as the engine tests' stock runs.
STOCK_KV_BYTES = str(256 << 20)


def _start(model, log: Path, extra_args: list[str], env_extra=None, backend="ulacache"):
    """`scripts/serve.sh MODEL BACKEND` on a free 127.0.0.1 port with the tight CPU budget of
    these tests (ulacache: an 11 MB KV budget and a 6 MiB host pool, both overflowed by the
    workloads below; stock: ``STOCK_KV_BYTES``); returns (process, base URL)."""
    from _vllm_subprocess import require_engine_marker, vllm_env

    require_engine_marker()
    port = _free_port()
    env = vllm_env(dict(
        VENV=str(Path(sys.executable).parent.parent),
        KV_CACHE_BYTES="11000000" if backend == "ulacache" else STOCK_KV_BYTES,
        MAX_MODEL_LEN="1024",
        VLLM_LOGGING_LEVEL="INFO"))  # the tests read the startup lines from the log
    env.update(env_extra or {})
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    ula = ["--ula-host-pool-gib", "0.006"] if backend == "ulacache" else []
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "serve.sh"), str(model), backend, "127.0.0.1",
             str(port), "--dtype", "float32", "--max-num-seqs", "8",
             *REFERENCE_PATH_FLAGS, *ula, *extra_args],
            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc, base: str, log: Path, deadline: float) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited early:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    pytest.fail(f"server did not become healthy:\n{log.read_text()[-4000:]}")


def _stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.poll() is not None


@contextlib.contextmanager
def serve_many(specs: list[dict], timeout: float = 300):
    """Boots one server per spec (``_start``'s keyword arguments) at the same time and yields
    their base URLs once all are healthy; stops every one after (also when a boot fails)."""
    procs = []
    try:
        for spec in specs:
            procs.append((*_start(**spec), spec["log"]))
        deadline = time.time() + timeout
        for proc, base, log in procs:
            _wait_healthy(proc, base, log, deadline)
        yield [base for _, base, _ in procs]
    finally:
        for proc, _, _ in procs:
            _stop(proc)


@pytest.fixture(scope="module")
def refusal(tiny_model, tmp_path_factory):
    """`vllm serve` with a KV budget too small for one step (known only inside the engine
    core), started before the module's servers so its start-up and failure overlap theirs
    (one vLLM import per process, single-threaded: three at once keep both cores busy).
    Yields ``wait() -> (returncode, stdout + stderr, error files before)``, read by
    test_engine_core_refusal_ends_serve_with_the_fix; the process is killed at the end if it
    is still running."""
    import glob
    import tempfile

    from _vllm_subprocess import require_engine_marker, vllm_env

    require_engine_marker()
    model = tiny_model("deepseek_v32")
    d = tmp_path_factory.mktemp("refusal")
    pattern = os.path.join(tempfile.gettempdir(), "ulacache-error-*")
    before = set(glob.glob(pattern))
    env = vllm_env({"VLLM_LOGGING_LEVEL": "INFO"})  # vLLM's default level, as before
    vllm_bin = Path(sys.executable).parent / "vllm"
    out, err = d / "stdout", d / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            [str(vllm_bin), "serve", str(model), "--kv-backend", "ulacache", "--dtype",
             "float32", "--ula-host-pool-gib", "0.006", "--kv-cache-memory-bytes", "1000000",
             "--max-model-len", "1024", "--port", str(_free_port()), *REFERENCE_PATH_FLAGS],
            stdout=fo, stderr=fe, env=env, cwd=d, start_new_session=True)

    def wait():
        proc.wait(timeout=300)
        return proc.returncode, out.read_text() + err.read_text(), before
    try:
        yield wait
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory, refusal):
    """The ulacache server under test and a stock (`--kv-backend vllm`) server of the same
    model and sampling settings, the reference of every greedy text checked here; booted
    side by side, their compute threads on disjoint CPUs (``side_by_side_binds``), while the
    ``refusal`` server fails."""
    from _vllm_subprocess import side_by_side_binds

    model = tiny_model("deepseek_v32")
    d = tmp_path_factory.mktemp("serve")
    log, stock_log = d / "serve.log", d / "stock.log"
    binds = side_by_side_binds(2) or [{}, {}]
    # The move-fault control file (`engine/faults.py`): absent, so no faults, until a
    # test writes one.
    with serve_many([
            dict(model=model, log=log, extra_args=HOLDABLE_ARGS,
                 env_extra={FAULTS_ENV: str(_faults_file(log)), **HOLDABLE_ENV, **binds[0]}),
            dict(model=model, log=stock_log, extra_args=[], env_extra=binds[1],
                 backend="vllm")]) as (base, stock_base):
        yield (base, str(model), log), stock_base


@pytest.fixture(scope="module")
def server(servers):
    """(base URL, model, log) of the ulacache server."""
    return servers[0]


@pytest.fixture(scope="module")
def stock(servers):
    """Base URL of the stock server."""
    return servers[1]


def _faults_file(log: Path) -> Path:
    return log.parent / "move_faults.json"


def _complete(base, model, prompt, n):
    r = requests.post(base + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def _growing_prompts(n: int, growth: int) -> list[str]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [" ".join(words[(i + j * 3) % len(words)] for j in range(40 + growth * i))
            for i in range(n)]


def concurrent_greedy(base, model, n: int, growth: int, stock: str | None = None,
                      log: Path | None = None) -> list[dict]:
    """``n`` concurrent 32-token greedy completions of prompts growing by ``growth`` words;
    checks their lengths and that a repeat of one gives the same text (greedy is
    deterministic, whichever engine serves it). With ``stock`` (a stock server's base URL)
    the same prompts go to it too, at the same time, and every text must be stock's. With
    ``log`` the ulacache server admits the batch together (`admitted_together`)."""
    prompts = _growing_prompts(n, growth)
    outs, ref = _both(base, stock, model, prompts, 32, log)
    assert all(o["usage"]["completion_tokens"] == 32 for o in outs)
    if stock is not None:
        _assert_texts_equal(outs, ref)
    again = _complete(base, model, prompts[n // 2 - 1], 32)
    assert again["choices"][0]["text"] == outs[n // 2 - 1]["choices"][0]["text"]
    return outs


@contextlib.contextmanager
def admitted_together(base: str, log: Path, n: int, timeout: float = 120):
    """Holds the server's scheduler while the ``with`` body sends ``n`` requests, and lets it
    go once the API server has handed all ``n`` to the engine: they are scheduled together,
    so a batch that outgrows the device pool does so on every host, however the client
    threads happen to be spread (a tiny model finishes a request in well under a second, so
    a late thread can otherwise start after the first ones ended, and no row ever moves).

    vLLM's own dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=keep`` freezes
    scheduling and ``/resume`` releases it; the API server logs "Added request" (with
    ``--enable-log-requests``) once an add is sent, and the engine core reads adds and the
    resume from one socket in order, so every counted add is queued before the resume."""
    start = len(log.read_text())
    r = requests.post(base + "/pause", params={"mode": "keep", "clear_cache": "false"},
                      timeout=30)
    r.raise_for_status()
    try:
        yield
        deadline = time.time() + timeout
        while log.read_text()[start:].count("Added request") < n:
            assert time.time() < deadline, f"the {n} requests did not reach the engine"
            time.sleep(0.05)
    finally:
        requests.post(base + "/resume", timeout=30).raise_for_status()


# What `admitted_together` needs of a server (its dev endpoints and its add log lines).
HOLDABLE_ARGS = ["--enable-log-requests", "--max-log-len", "0"]
HOLDABLE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def _both(base, stock, model, prompts, n, log: Path | None = None):
    """Greedy ``n``-token completions of every prompt from the ulacache server and, when
    ``stock`` is given, from the stock server, all at once; returns (ulacache completions,
    stock completions or None). With ``log`` (the ulacache server's, started with
    ``HOLDABLE_ARGS``/``HOLDABLE_ENV``) its requests are `admitted_together`."""
    with cf.ThreadPoolExecutor(2 * len(prompts)) as ex:
        ref = [ex.submit(_complete, stock, model, p, n) for p in prompts] if stock else None
        with admitted_together(base, log, len(prompts)) if log else contextlib.nullcontext():
            ula = [ex.submit(_complete, base, model, p, n) for p in prompts]
        return [f.result() for f in ula], None if ref is None else [f.result() for f in ref]


def _assert_texts_equal(outs, ref) -> None:
    """ulacache's completions against stock's, prompt by prompt (texts and token counts)."""
    got = [o["choices"][0]["text"] for o in outs]
    want = [o["choices"][0]["text"] for o in ref]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not bad, \
        f"ulacache differs from stock on prompts {bad}: {[(got[i], want[i]) for i in bad[:2]]}"
    assert [o["usage"] for o in outs] == [o["usage"] for o in ref]


def _moved(m0: str, m1: str) -> dict[str, float]:
    """Increases of ulacache's tier-movement counters between two `/metrics` texts."""
    return {k: _metric(m1, f"vllm:ulacache_{k}_total") - _metric(m0, f"vllm:ulacache_{k}_total")
            for k in ("demotions", "promotions", "lookups", "bytes_moved")}


def test_single_completion(server):
    base, model, _ = server
    out = _complete(base, model, "hello there, tiny model", 8)
    assert out["choices"][0]["text"] != ""
    assert out["usage"]["completion_tokens"] == 8


def test_concurrent_completions_equal_stock_and_move_ulacache_metrics(server, stock):
    """Eight concurrent greedy completions that outgrow the device pool: every text is the
    stock server's for the same prompt, and ulacache's counters show the host tier was used
    (rows demoted and promoted)."""
    base, model, log = server
    before = requests.get(base + "/metrics", timeout=10).text
    concurrent_greedy(base, model, n=8, growth=15, stock=stock, log=log)
    after = _pools_back_to_zero(base)
    moved = _moved(before, after)
    assert all(v > 0 for v in moved.values()), (moved, after[-3000:])
    assert _metric(after, "vllm:ulacache_device_capacity") > 0
    assert "ulacache KV:" in log.read_text()  # startup summary line


def test_engine_core_refusal_ends_serve_with_the_fix(refusal):
    """A KV budget too small for one step is only known inside the engine core: `vllm serve`
    must still end with ulacache's message (the numbers and the fix), not vLLM's generic
    "Engine core initialization failed", and leave no error file behind."""
    import glob
    import tempfile

    returncode, output, before = refusal()
    assert returncode != 0
    lines = [ln for ln in output.splitlines() if ln.strip()]
    err = [ln for ln in lines if "KVBackendError" in ln]
    assert err and "device pool too small" in err[-1] and "at least" in err[-1], lines[-20:]
    assert not any("Engine core initialization failed" in ln for ln in lines[-5:]), lines[-5:]
    pattern = os.path.join(tempfile.gettempdir(), "ulacache-error-*")
    assert set(glob.glob(pattern)) <= before, "an error file was left behind"


def _stream(base, model, prompt, n, cut_after=None):
    """A streaming greedy completion; with ``cut_after`` the client hangs up after that many
    chunks (vLLM aborts the request on disconnect). Returns the text received."""
    text = []
    with requests.post(base + "/v1/completions", stream=True, timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for i, line in enumerate(r.iter_lines()):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            text.append(__import__("json").loads(line[6:])["choices"][0]["text"])
            if cut_after is not None and len(text) >= cut_after:
                break  # leaving the block closes the connection mid-stream
    return "".join(text)


def _abort_in_prefill(base, model, prompt):
    """Send a long prompt and hang up before the first token (a read timeout)."""
    try:
        requests.post(base + "/v1/completions", timeout=(5, 0.05), json={
            "model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True})
    except requests.exceptions.ReadTimeout:
        return True
    return False


def _pools_back_to_zero(base, timeout: float = 90) -> str:
    """Waits until both pools are empty and no request runs or waits; returns `/metrics`."""
    deadline = time.time() + timeout
    while True:
        m = requests.get(base + "/metrics", timeout=10).text
        used = (_metric(m, "vllm:ulacache_device_used"), _metric(m, "vllm:ulacache_host_used"),
                _metric(m, "vllm:num_requests_running"), _metric(m, "vllm:num_requests_waiting"))
        if used == (0, 0, 0, 0):
            return m
        assert time.time() < deadline, f"pools/requests not back to zero: {used}"
        time.sleep(1)


def test_load_with_client_aborts_leaves_the_pools_clean(server, stock):
    """A bounded loopback load beyond the pools' capacity: concurrent streams, a third cut by
    the client mid-stream, some aborted during prefill. Afterwards both pools are back to
    zero, nothing but the cut requests failed, the load spilled rows to the host and fetched
    them back, every uncut stream equals the stock server's greedy text for its prompt, and
    the server still answers."""
    base, model, log = server
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    prompts = [" ".join(words[(i * 5 + j * (i + 2)) % len(words)] for j in range(60 + 25 * i))
               for i in range(12)]
    streams = [i for i in range(12) if i % 4 != 3]
    m0 = requests.get(base + "/metrics", timeout=10).text
    jobs = []
    with cf.ThreadPoolExecutor(12 + 12) as ex:
        # The streams start together (their load outgrows the pools on every host); the
        # prefill aborts arrive while they run, beside their decodes.
        with admitted_together(base, log, len(streams)):
            for i in streams:
                jobs.append(("cut", i, ex.submit(_stream, base, model, prompts[i], 48, 3))
                            if i % 3 == 1 else
                            ("full", i, ex.submit(_stream, base, model, prompts[i], 48)))
        for i in set(range(12)) - set(streams):
            jobs.append(("prefill", i, ex.submit(_abort_in_prefill, base, model, prompts[i])))
        # The uncut prompts' stock texts, at the same time (the stock server has its own CPU).
        ref = {i: ex.submit(_complete, stock, model, prompts[i], 48)
               for kind, i, _ in jobs if kind == "full"}
        results = [(kind, i, f.result()) for kind, i, f in jobs]  # raises if any failed
        ref = {i: f.result()["choices"][0]["text"] for i, f in ref.items()}
    full = {i: t for kind, i, t in results if kind == "full"}
    assert len(full) >= 5 and all(t for t in full.values())
    assert any(kind == "prefill" and ok for kind, _, ok in results)
    m = _pools_back_to_zero(base)
    # The load did spill to the host and back (the pools really were under pressure).
    moved = _moved(m0, m)
    assert moved["demotions"] > 0 and moved["promotions"] > 0, moved
    bad = {i: (t, ref[i]) for i, t in full.items() if t != ref[i]}
    assert not bad, f"uncut streams differ from stock: {bad}"
    assert _complete(base, model, "still serving?", 4)["usage"]["completion_tokens"] == 4


# ----------------------------------------------- faults in the move path, bad requests
def _finished(text: str, reason: str) -> float:
    """Requests vLLM counted as finished for ``reason`` (stop, length, abort, error)."""
    return sum(float(v) for v in re.findall(
        rf'^vllm:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$', text, re.M))


def _arm(log: Path, **spec) -> None:
    """Arms a move fault in the server's workers (read at their next step)."""
    _faults_file(log).write_text(__import__("json").dumps({**spec, "nonce": time.time()}))


@pytest.fixture(scope="module")
def pressure_batch(server, stock):
    """Eight concurrent greedy completions that outgrow the device pool (rows are demoted
    and promoted), served without faults, each the stock server's text: (prompts, texts)."""
    base, model, log = server
    prompts = _growing_prompts(8, 15)
    m0 = requests.get(base + "/metrics", timeout=10).text
    outs, ref = _both(base, stock, model, prompts, 32, log)
    m1 = _pools_back_to_zero(base)
    moved = _moved(m0, m1)
    assert moved["demotions"] > 0 and moved["promotions"] > 0, moved
    _assert_texts_equal(outs, ref)
    return prompts, [o["choices"][0]["text"] for o in outs]


def test_stalled_moves_change_no_output(server, pressure_batch):
    """Copies that stall (and a stream cut by its client meanwhile) delay the batch; every
    uncut completion is still the text the batch gets without stalls, and the pools drain."""
    base, model, log = server
    prompts, want = pressure_batch
    _arm(log, fault="stall", seconds=0.4, count=4)
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            with admitted_together(base, log, len(prompts)):
                futs = [ex.submit(_stream, base, model, p, 32, 2 if i == 5 else None)
                        for i, p in enumerate(prompts)]
            got = [f.result() for f in futs]
    finally:
        _faults_file(log).write_text("")
    assert [t for i, t in enumerate(got) if i != 5] == [t for i, t in enumerate(want) if i != 5]
    assert log.read_text().count("ulacache test fault") >= 1  # the stalls happened
    _pools_back_to_zero(base)


def test_a_failed_move_ends_its_requests_with_an_error_and_no_other(server, pressure_batch):
    """A copy that raises in the worker's move path: the requests whose rows it lost end
    with an error the client sees (HTTP 500, counted as finished_reason="error"), never with
    wrong tokens; every other request of the batch gets its usual text; the pools drain and
    the server keeps serving (the failed prompts, sent again, get their usual text)."""
    base, model, log = server
    prompts, want = pressure_batch
    m0 = requests.get(base + "/metrics", timeout=10).text

    def post(p):
        return requests.post(base + "/v1/completions", timeout=300, json={
            "model": model, "prompt": p, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True})

    _arm(log, fault="raise", moves=["demote", "promote"], skip=2, count=1)
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            with admitted_together(base, log, len(prompts)):
                futs = [ex.submit(post, p) for p in prompts]
            res = [f.result() for f in futs]
    finally:
        _faults_file(log).write_text("")
    failed = [i for i, r in enumerate(res) if r.status_code != 200]
    assert failed, "the injected copy failure must end some request"
    for i in failed:
        assert res[i].status_code == 500 and "error" in res[i].json(), res[i].text
    for i, r in enumerate(res):
        if i not in failed:
            assert r.json()["choices"][0]["text"] == want[i], i
    text = log.read_text()
    assert "a row copy failed" in text and "KV load failure" in text
    m1 = _pools_back_to_zero(base)
    assert _finished(m1, "error") - _finished(m0, "error") == len(failed)
    assert (_metric(m1, "vllm:ulacache_failed_copies_total")
            - _metric(m0, "vllm:ulacache_failed_copies_total")) == 1
    with cf.ThreadPoolExecutor(len(failed)) as ex:
        again = list(ex.map(lambda i: _complete(base, model, prompts[i], 32), failed))
    assert [o["choices"][0]["text"] for o in again] == [want[i] for i in failed]


def test_bad_requests_get_a_clear_error_and_leave_the_pools_clean(server):
    """Run-time limits under ulacache, as the client sees them: a prompt longer than
    max_model_len gets HTTP 400 naming the limit; a completion that would outgrow it is cut
    at max_model_len (vLLM 0.32 clamps max_tokens), and that largest request runs alone (no
    request can need more than device + host: startup refuses pools that cannot hold one of
    max_model_len); a request whose client hangs up during its prefill is aborted, not run
    to its end. Afterwards the pools are empty."""
    base, model, _ = server
    ids = requests.post(base + "/tokenize", timeout=10, json={
        "model": model, "prompt": "one two three four five six seven eight"}).json()["tokens"]
    prompt = (ids * 1000)[:1000]  # token ids: exact lengths (max_model_len is 1024)
    m0 = _pools_back_to_zero(base)

    def post(p, n, timeout=300):
        return requests.post(base + "/v1/completions", timeout=timeout, json={
            "model": model, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True})

    r = post((ids * 200)[:1100], 4)
    assert r.status_code == 400, r.text
    assert "maximum context length is 1024" in r.json()["error"]["message"], r.text
    # Hang up while the 1000-token prefill runs (~0.5 s on the CI host), then send the same
    # request to its end: had the first not been aborted, both would finish as "length".
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(prompt, 100, timeout=(5, 0.1))
    r = post(prompt, 100)  # 1000 + 100 > 1024: cut at max_model_len
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 24 and out["choices"][0]["finish_reason"] == "length"
    m1 = _pools_back_to_zero(base)
    assert _finished(m1, "length") - _finished(m0, "length") == 1, "the hung-up request ran on"
