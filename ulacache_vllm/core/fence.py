"""Fences: the "signal" of the ordering rule copy data -> update mapping -> signal.

A ``Fence`` completes when it is signalled, or when the event it wraps reports completion
(anything with ``query()``, e.g. ``torch.cuda.Event``). ``ManualEvent`` is a CPU stand-in for
an asynchronous copy, used by tests to hold a move in flight.
"""

from __future__ import annotations


class ManualEvent:
    def __init__(self) -> None:
        self._done = False

    def set(self) -> None:
        self._done = True

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        if not self._done:
            raise RuntimeError("ManualEvent.synchronize() on an event nobody will set")


class Fence:
    def __init__(self, event=None) -> None:
        self.event = event
        self._signalled = False

    def signal(self) -> None:
        self._signalled = True

    @property
    def completed(self) -> bool:
        return self._signalled

    def copy_done(self) -> bool:
        """Whether the data copy behind this fence has finished (the mapping may then commit)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block until the copy is done (attention waits here before reading moved rows)."""
        if self.event is not None and not self.event.query():
            self.event.synchronize()
