"""Triton's interpreter for the kernel tests (``test_kernels.py``, ``test_queue_kernels.py``),
and only for them.

Triton decides compiled vs interpreted when ``@triton.jit`` decorates a function: its own
``triton.language`` helpers when Triton is first imported, a kernel when its module is
imported; its interpreter reads ``TRITON_INTERPRET`` again while a kernel runs
(``constexpr_function`` results). So the variable must be set while those modules import
Triton and their kernels (before anything else in the process imported Triton) and while their
tests run, and nowhere else: an engine, server or lm-eval
subprocess started later by the same pytest process must not inherit it (vLLM never runs
Triton's interpreter). ``interpreted()`` sets it and puts back the previous value (or its
absence); the kernel test modules import Triton and their kernels inside it, and ``tests/core/conftest.py``'s
``triton_interpreter`` fixture holds it for their tests. ``tests/conftest.py`` fails the
collection of any test module that leaves it changed.
"""
from __future__ import annotations

import contextlib
import os

ENV = "TRITON_INTERPRET"


@contextlib.contextmanager
def interpreted():
    """``TRITON_INTERPRET=1`` in this process inside the block; the previous state after."""
    old = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old
