"""SIGTERM and SIGHUP handled as Ctrl-C, so that a process manager stopping the tuner, or the terminal it ran in
closing, ends its trials and writes its outputs the way an interrupted terminal does."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TextIO


AGAIN_S = 0.05  # after a swallowed Ctrl-C, when SIGINT comes again (_interrupt_again)


@contextmanager
def stop_signals_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, and a Ctrl-C the garbage
    collector swallowed is raised again (_interrupt_again); the previous handlers come back afterwards. A SIGHUP already ignored stays ignored (`nohup autotune ...`: asked to outlive the terminal).
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
    unraisable = sys.unraisablehook
    sys.unraisablehook = _interrupt_again(unraisable)
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupt_again(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable-exception hook that gives a swallowed Ctrl-C back: a KeyboardInterrupt raised where Python can
    only print it (a finalizer or a weakref callback run by the garbage collector: "Exception ignored in ...") was
    lost, and the sweep ran on to its end. SIGINT is sent again a moment later, from a thread: the main thread meets it
    at its next step (raised at once, it would land in this hook, and be swallowed again)."""

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            again = threading.Timer(AGAIN_S, os.kill, (os.getpid(), signal.SIGINT))
            again.daemon = True
            again.start()
            return
        previous(unraisable)

    return hook


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


@contextmanager
def deferred_signals() -> Iterator[list[int]]:
    """Within the block, the first SIGINT, SIGTERM or SIGHUP (unless ignored) is noted in the list yielded rather than
    raised; a second raises KeyboardInterrupt. The previous handlers come back afterwards. Outside the main thread it
    notes nothing."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def note(signum: int, frame: Any) -> None:
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)

    handled = [signal.SIGINT, signal.SIGTERM] + \
        ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else [])
    previous = {signum: signal.signal(signum, note) for signum in handled}
    try:
        yield caught
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
