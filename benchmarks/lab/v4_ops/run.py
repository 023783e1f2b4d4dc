"""Lab only: run a command with the emulated V4 ops in every Python process it starts.

    python benchmarks/lab/v4_ops/run.py -m pytest tests/test_v4_line.py -x
    python benchmarks/lab/v4_ops/run.py benchmarks/v4_capacity.py --prefix-caching
    ULACACHE_LAB_AMX_SCHEDULE=1 python benchmarks/lab/v4_ops/run.py -m pytest ...

(the last: V4 configured as on an AMX host, chunked prefill and prefix caching kept; see
``boot/sitecustomize.py``). The arguments are handed to this interpreter
(``sys.executable``) with ``boot/`` first on PYTHONPATH and ``ULACACHE_LAB_V4_OPS=1`` (see
``__init__``: figures from such a run measure everything but V4's kernels, and say so where
they are written down).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BOOT = Path(__file__).resolve().parent / "boot"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT), env.get("PYTHONPATH", "")) if p)
    env["ULACACHE_LAB_V4_OPS"] = "1"
    return subprocess.call([sys.executable, *argv], env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
