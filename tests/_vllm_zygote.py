"""A pre-imported vLLM interpreter that forks the test suite's engine scripts.

Most of a tiny-model engine script is importing vLLM (~14 s of one core on a 2-core host,
against ~4 s to build the engine): the suite starts ~60 such interpreters. The zygote is one
interpreter that imports vLLM once and then forks a child per script; a child runs the script
as ``python script.py`` would (``__main__``, ``sys.argv``, ``sys.path[0]``, working
directory, stdin from /dev/null, stdout and stderr to the given files) with the script's
environment, and exits through the interpreter's normal shutdown. ``run_vllm_script`` uses it
for a script only when the child would be the same as a fresh interpreter
(``Zygote.accepts``); otherwise it starts a fresh one, as before.

Invariants:
- The zygote never builds an engine, runs an OpenMP region or starts a thread of its own: what
  is forked is imports only (vLLM, its engine core and CPU worker modules; the plugin is
  loaded by each engine, in the child).
- A child's environment differs from the zygote's start-up one only in keys read when used,
  not at import (``MAY_DIFFER``; ulacache's own ``ULACACHE_*`` but the lab's, which its
  boot reads at start-up): the difference is applied on top of the zygote's environment as
  its imports left it (vLLM's import sets a few keys, as it would in a fresh interpreter).
  GNU OpenMP reads ``OMP_NUM_THREADS``/``OMP_PLACES``/``OMP_PROC_BIND`` when torch loads it,
  so for a zygote started without OpenMP settings the child applies them itself, only as the
  whole triple the harness writes (a thread count, one place ``{cpus}``, bound): the place as
  the process's CPU affinity (its threads are created after, inheriting it), the count through
  torch. Anything else that differs: a fresh interpreter. The zygote's replies go on a
  descriptor of their own (whatever its imports print goes to its log); one that fails or
  is interrupted mid-request is killed, and scripts start fresh interpreters from then on.
- Exit statuses: the zygote reaps its children and writes each one's return code (negative:
  the killing signal, as ``subprocess.Popen.returncode``) to the file the request named.
- On end of input (the test process gone) it waits for its children (60 s) and kills those
  still running.

Protocol (stdin/stdout, one JSON object per line): the zygote first writes ``{"ready": pid,
"imported": {key: value}}`` (the environment keys its imports set);
each request ``{"script", "env", "cwd", "stdout", "stderr", "rc"}`` is answered with
``{"pid": n}`` (or ``{"error": text}``).
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# Read when used, never at import: a child may carry other values than the zygote.
MAY_DIFFER = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU", "ULACACHE_SCRIPT_ARGS",
                        "PYTEST_CURRENT_TEST"})
OMP_KEYS = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND")
_ONE_PLACE = re.compile(r"^\{(\d+(?:,\d+)*)\}$")
# Any of these in the zygote's own start-up: OpenMP was set up there; no child may differ.
_OMP_SETUP = ("OMP_", "GOMP_", "KMP_AFFINITY")
READY_TIMEOUT_S = 300.0
CHILD_GRACE_S = 60.0


def _may_differ(key: str) -> bool:
    return key in MAY_DIFFER or (key.startswith("ULACACHE_")
                                 and not key.startswith("ULACACHE_LAB_"))


# ---------------------------------------------------------------------------------------------
# The zygote process
# ---------------------------------------------------------------------------------------------


def _preload() -> None:
    import vllm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401


def _apply_omp(env: dict[str, str]) -> None:
    """In the child: the OpenMP settings the zygote's start-up lacked (see the invariants)."""
    places = env.get("OMP_PLACES")
    if places is not None:
        os.sched_setaffinity(0, {int(c) for c in _ONE_PLACE.match(places).group(1).split(",")})
    if env.get("OMP_NUM_THREADS") is not None:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _child(req: dict, startup_env: dict[str, str], proto_fd: int) -> None:
    """Become the script's interpreter; never returns (exits through SystemExit)."""
    code = 1
    try:
        fd = os.open(os.devnull, os.O_RDWR)
        os.dup2(fd, 0)
        os.dup2(fd, proto_fd)  # (the zygote's replies are not the child's to hold open)
        os.close(fd)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = req["env"]
        for k in set(env) | set(startup_env):  # the request's difference, on the zygote's
            if env.get(k) != startup_env.get(k):
                if k in env:
                    os.environ[k] = env[k]
                else:
                    os.environ.pop(k, None)
        if any(k not in startup_env for k in OMP_KEYS if k in env):
            _apply_omp(env)
        os.chdir(req["cwd"])
        script = req["script"]
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
        import runpy

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def _reap(rc_files: dict[int, str]) -> None:
    while rc_files:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = rc_files.pop(pid, None)
        if path:
            try:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(path + ".tmp", path)
            except OSError as e:  # (its directory removed: no one is waiting for it)
                print(f"vLLM zygote: return code of {pid} not written: {e!r}", file=sys.stderr)


def serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the test process decides; EOF ends us
    startup_env = dict(os.environ)
    # Replies on a descriptor of their own: whatever the imports print goes to the log.
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(proto_fd, "w")
    sys.path[0] = os.getcwd()  # (its own directory: nothing of tests/ shadows an import)
    _preload()
    imported = {k: v for k, v in os.environ.items() if startup_env.get(k) != v}
    out.write(json.dumps({"ready": os.getpid(), "imported": imported}) + "\n")
    out.flush()
    rc_files: dict[int, str] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.2)
        _reap(rc_files)
        if not ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            sys.stdout.flush()  # (nothing buffered may reach a child's output)
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:
                out.write(json.dumps({"error": repr(e)}) + "\n")
                out.flush()
                continue
            if pid == 0:
                _child(req, startup_env, proto_fd)
            rc_files[pid] = req["rc"]
            out.write(json.dumps({"pid": pid}) + "\n")
            out.flush()
    deadline = time.monotonic() + CHILD_GRACE_S
    while rc_files and time.monotonic() < deadline:
        _reap(rc_files)
        time.sleep(0.2)
    for pid in list(rc_files):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while rc_files:
        _reap(rc_files)
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# The test process's side
# ---------------------------------------------------------------------------------------------


class ForkedProcess:
    """A zygote child, with the part of ``subprocess.Popen``'s interface the suite uses."""

    def __init__(self, pid: int, rc_path: Path, args: list[str], zygote: "Zygote"):
        self.pid, self.args, self.returncode = pid, args, None
        self._rc_path, self._zygote = rc_path, zygote
        self._gone_since: float | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._rc_path.read_text())
            except (FileNotFoundError, ValueError):
                if _alive(self.pid):
                    self._gone_since = None
                elif self._zygote.dead():
                    self.returncode = -signal.SIGKILL  # reaped by init: status unknown
                elif self._gone_since is None:
                    self._gone_since = time.monotonic()
                elif time.monotonic() - self._gone_since > 2.0:  # reaped, no code written
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Zygote:
    """The test process's handle: started once with ``env`` (a script environment without
    extras); ``spawn`` forks a script when ``accepts`` its environment."""

    def __init__(self, env: dict[str, str]):
        import tempfile

        self.env = dict(env)
        self.imported: dict[str, str] = {}  # what vLLM's import set in the zygote's environment
        self._lock = threading.Lock()
        self._ready = False
        self._seq = 0
        # Its log and its children's return codes (not in the scripts' own directories,
        # which their callers may remove before a child has exited).
        self.dir = Path(tempfile.mkdtemp(prefix="ulacache_vllm_zygote_"))
        self._log = open(self.dir / "zygote.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=self.env,
                                     cwd=str(self.dir))

    def dead(self) -> bool:
        return self.proc.poll() is not None

    def accepts(self, env: dict[str, str]) -> bool:
        return not self.refusal(env)

    def refusal(self, env: dict[str, str]) -> list[str]:
        """The keys of ``env`` that keep it from a forked child (empty: accepted)."""
        if not self._ready:
            self._wait_ready()
        keys = []
        for k in set(env) | set(self.env):
            if env.get(k) == self.env.get(k) or _may_differ(k):
                continue
            if k in OMP_KEYS and not any(z.startswith(_OMP_SETUP) for z in self.env):
                continue
            # Set by vLLM's import (in the test process too, where it imported vLLM): the
            # value that import leaves is the one a fresh interpreter would end with.
            if k in self.imported and env.get(k) == self.imported[k] \
                    and not k.startswith(("LD_", "PYTHON")):
                continue
            keys.append(k)
        omp = {k: env[k] for k in OMP_KEYS if k in env and env[k] != self.env.get(k)}
        if omp and not (len(omp) == 3 and omp["OMP_NUM_THREADS"].isdigit()
                        and _ONE_PLACE.match(omp["OMP_PLACES"])
                        and omp["OMP_PROC_BIND"] == "true"):
            keys.append("OMP_*")  # only the whole triple of one bound place is reproduced
        return sorted(set(keys))

    def _wait_ready(self) -> None:
        with self._lock:
            if not self._ready:
                try:
                    # {"ready": pid, "imported": {...}}: the imports are done
                    got = self._reply(READY_TIMEOUT_S)
                    self.imported = got["imported"]
                except BaseException:
                    self.kill()
                    raise
                self._ready = True

    def kill(self) -> None:
        """Take the zygote out of use (its running children are left to finish)."""
        if not self.dead():
            self.proc.kill()
            self.proc.wait()

    def _reply(self, timeout: float | None = None) -> dict:
        if timeout is not None:
            import select as _select

            if not _select.select([self.proc.stdout], [], [], timeout)[0]:
                raise RuntimeError(f"the vLLM zygote did not answer in {timeout:.0f} s; its "
                                   f"log: {self._log.name}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM zygote exited ({self.proc.poll()}); its log: "
                               f"{self._log.name}")
        return json.loads(line)

    def spawn(self, script: Path, env: dict[str, str], cwd: Path, stdout: Path,
              stderr: Path) -> ForkedProcess:
        for path in (stdout, stderr):  # (there before the call returns, as with Popen)
            Path(path).touch()
        if not self._ready:
            self._wait_ready()
        with self._lock:
            self._seq += 1
            rc = self.dir / f"{self._seq}.returncode"
            req = dict(script=str(script), env=env, cwd=str(cwd), stdout=str(stdout),
                       stderr=str(stderr), rc=str(rc))
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
                got = self._reply(60.0)
            except BaseException:  # (an interrupt between request and reply included)
                self.kill()  # never pair a later request with this one's reply
                raise
        if "pid" not in got:
            raise RuntimeError(f"the vLLM zygote could not fork: {got}")
        return ForkedProcess(got["pid"], rc, [sys.executable, str(script)], self)

    def close(self) -> None:
        """End of input: the zygote waits for its children (``CHILD_GRACE_S``), then exits."""
        if self.dead():
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=CHILD_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if self.proc.returncode == 0:
            import shutil

            shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    serve()
