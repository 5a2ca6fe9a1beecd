"""SIGTERM handled as Ctrl-C, so that a process manager stopping the tuner ends its trials and writes its
outputs the way an interrupted terminal does."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt in the main thread; the previous handler comes
    back afterwards. Outside the main thread (where handlers cannot be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
