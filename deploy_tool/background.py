"""Independent round trips (systemctl, journalctl, file reads) run side by side on threads.

The waits release the GIL, so two systemctl calls cost about one. Errors are kept and raised in the caller's
thread, where it asks for the result.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """One call on a thread, started at once; `result()` waits and returns its value or raises its error."""

    def __init__(self, fn: Callable[[], T], name: str = "deploytool-bg") -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            self._error = exc

    def wait(self) -> BaseException | None:
        """Wait; the error the call raised, if any."""
        self._thread.join()
        return self._error

    def result(self) -> T:
        """Wait; the call's value, or raise what it raised."""
        err = self.wait()
        if err is not None:
            raise err
        return self._value  # type: ignore[return-value]


def together(*fns: Callable[[], object]) -> None:
    """Run the calls at the same time (the first on this thread); once all have finished, raise the first
    error in argument order."""
    jobs = [Background(fn) for fn in fns[1:]]
    first: BaseException | None = None
    try:
        fns[0]()
    except BaseException as exc:  # noqa: BLE001 - raised below, after the others finished
        first = exc
    errors = [first, *(j.wait() for j in jobs)]
    for e in errors:
        if e is not None:
            raise e
