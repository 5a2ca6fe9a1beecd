"""SIGTERM and SIGHUP handled as Ctrl-C, so that a process manager stopping the tuner, or the terminal it ran in
closing, ends its trials and writes its outputs the way an interrupted terminal does."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, TextIO


@contextmanager
def stop_signals_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread; the previous handlers come
    back afterwards. A SIGHUP already ignored stays ignored (`nohup autotune ...`: asked to outlive the terminal).
    Outside the main thread (where handlers cannot be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    terminals = _terminals()  # asked now: a hung-up terminal no longer answers as one

    def interrupt(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            _leave(terminals)
        raise KeyboardInterrupt

    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        handled.append(signal.SIGHUP)
    previous = {signum: signal.signal(signum, interrupt) for signum in handled}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _terminals() -> list[tuple[TextIO, int]]:
    """stdout and stderr where they are a terminal, with their file descriptors."""
    found = []
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and stream.isatty():
                found.append((stream, stream.fileno()))
        except (OSError, ValueError):  # closed, or no file behind it
            continue
    return found


def _leave(terminals: list[tuple[TextIO, int]]) -> None:
    """A hung-up terminal answers every write with EIO: the lines written from here on (the outputs' summary)
    go nowhere rather than failing the outputs' writing. A file or pipe (a scheduler's log) keeps them."""
    with open(os.devnull, "w") as null:
        for stream, fd in terminals:
            try:
                stream.flush()
            except (OSError, ValueError):  # the terminal is gone already: what was buffered goes with the rest
                pass
            os.dup2(null.fileno(), fd)
