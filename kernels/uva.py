"""Device views of host memory (UVA), for kernels that read the host pool in place.

``host_view(t, device)``: ``t`` itself when ``device`` is the CPU (or ``t``'s own device);
for a CUDA device, a CUDA tensor aliasing the pinned CPU tensor ``t`` (same shape, strides and
bytes; no copy): device kernels that read it read host memory over the bus (zero-copy), and
stream-ordered writes through it land in host memory in stream order. ``t`` must be pinned
(page-locked and registered: ``pin_memory()``, or exact-size ``cudaHostRegister``); the view
keeps ``t`` alive.

The device address comes from ``cudaHostGetDevicePointer`` through cuda-python
(``cuda.bindings.runtime`` or the older ``cuda.cudart``) when installed, else it is the host
address itself, which is what CUDA returns for pinned memory wherever unified addressing is on
(every 64-bit Linux platform CUDA supports). ``VIEW_SOURCE`` records which was used. The tensor
is built from ``__cuda_array_interface__`` (torch checks the address is registered with CUDA).
vLLM's own ``get_accelerator_view_from_cpu_tensor`` does the same with a compiled op; this one
needs no vLLM. Not exercised on a GPU by the CPU tests (``scripts/gpu_kernel_check.py`` checks
it where a GPU is lent).
"""
from __future__ import annotations

import torch

VIEW_SOURCE = {"how": None}

_TYPESTR = {torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
            torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4",
            torch.float64: "<f8"}


class _CudaArray:
    def __init__(self, ptr: int, t: torch.Tensor, typestr: str):
        self._owner = t  # keeps the host memory alive as long as the view
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": tuple(t.shape), "typestr": typestr,
            "strides": tuple(s * t.element_size() for s in t.stride()), "version": 3,
            "stream": None,  # no synchronisation: the memory is host memory
        }


def _device_pointer(host_ptr: int) -> int:
    errors = []
    for modname in ("cuda.bindings.runtime", "cuda.cudart"):
        try:
            rt = __import__(modname, fromlist=["cudaHostGetDevicePointer"])
            err, dptr = rt.cudaHostGetDevicePointer(host_ptr, 0)
        except Exception as e:  # noqa: BLE001  (not installed, a broken install, an old API)
            errors.append(f"{modname}: {e!r}"[:200])
            continue
        if int(err) != 0:
            raise RuntimeError(f"cudaHostGetDevicePointer failed ({err}): is the tensor pinned?")
        VIEW_SOURCE["how"] = f"cudaHostGetDevicePointer ({modname})"
        return int(dptr)
    VIEW_SOURCE["how"] = "unified addressing (device address == host address)"
    VIEW_SOURCE["tried"] = errors
    return host_ptr


def host_view(t: torch.Tensor, device) -> torch.Tensor:
    """A tensor on ``device`` over ``t``'s memory (module doc)."""
    device = torch.device(device)
    if device.type == "cpu" or t.device == device:
        return t
    if device.type != "cuda" or t.device.type != "cpu":
        raise ValueError(f"host_view: a CPU tensor viewed from CUDA, got {t.device} -> {device}")
    if not t.is_pinned():
        raise ValueError("host_view: the host tensor must be pinned (pin_memory() or "
                         "cudaHostRegister)")
    if t.dtype not in _TYPESTR:
        raise TypeError(f"host_view: unsupported dtype {t.dtype}")
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    with torch.cuda.device(device):
        ptr = _device_pointer(t.data_ptr())
        return torch.as_tensor(_CudaArray(ptr, t, _TYPESTR[t.dtype]), device=device)
