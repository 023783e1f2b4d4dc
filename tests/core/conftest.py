"""Make ``ulacache_vllm.kernels`` importable from a source checkout that is not pip-installed
(setup.cfg maps it to the top-level ``kernels/`` directory)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import ulacache_vllm.kernels  # noqa: F401
except ModuleNotFoundError:
    import ulacache_vllm

    spec = importlib.util.spec_from_file_location(
        "ulacache_vllm.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ulacache_vllm.kernels"] = mod
    spec.loader.exec_module(mod)
    ulacache_vllm.kernels = mod
