"""A call made once, whoever asks how often: later callers wait for the first one and get its outcome."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Once:
    """The trainer actor's run() (one training per life of the actor): a driver whose call failed in a
    network partition, not in a restart, asks again, and must get the outcome of the training still
    under way, never a second one beside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the first call; every call returns (or raises) what that one did."""
        with self._lock:
            first, self._started = not self._started, True
        if first:
            try:
                self._result = fn(*args)
            except BaseException as e:
                self._error = e
            finally:
                self._done.set()
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result
