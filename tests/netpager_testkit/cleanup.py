"""Undo registry: every resource a test creates is undone on every exit path.

A `Teardown` is a stack of (what, undo) pairs. Resources push their undo
action the moment they exist; `close()` pops and runs them in reverse order,
collecting errors instead of stopping at the first one. Fixture finalizers
call `close()`; `install_handlers()` adds atexit and SIGINT/SIGTERM/SIGHUP
handlers that close every live Teardown, so Ctrl-C, a CI timeout's SIGTERM or
a plain exit also leave nothing behind.

A signal that arrives while a cleanup is running is acted on once that
cleanup is done: interrupting `swapoff` halfway and then detaching the loop
device under it would leave more behind, not less. Repeated signals (Ctrl-C
reaches both a script and its child) are undone once.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
from typing import Callable

_live: list["Teardown"] = []
_lock = threading.RLock()
_cleaning = 0
_deferred: list[int] = []
_handling = False
_installed = False


class CleanupError(RuntimeError):
    """One or more undo actions failed; the message lists each of them."""


class Teardown:
    """A stack of undo actions, run in reverse order by `close()`."""

    def __init__(self, name: str, announce: Callable[[str], None] | None = None):
        self.name = name
        self.announce = announce
        self._stack: list[tuple[str, Callable[[], None]]] = []
        self.logs: list[str] = []
        self.errors: list[str] = []
        with _lock:
            _live.append(self)

    def add(self, what: str, undo: Callable[[], None]) -> None:
        """Registers `undo` for the resource described by `what`."""
        with _lock:
            self._stack.append((what, undo))

    def add_log(self, path) -> None:
        """Remembers a log file so a failing test can print where it is."""
        self.logs.append(str(path))

    def pending(self) -> list[str]:
        """What is still to be undone, newest first."""
        with _lock:
            return [what for what, _ in reversed(self._stack)]

    def close(self) -> list[str]:
        """Undoes everything still registered; returns the failures, if any."""
        global _cleaning
        with _lock:
            _cleaning += 1
        try:
            while True:
                with _lock:
                    if not self._stack:
                        break
                    what, undo = self._stack.pop()
                if self.announce:
                    self.announce(what)
                try:
                    undo()
                except Exception as e:  # noqa: BLE001 - keep undoing the rest
                    msg = f"{self.name}: undo {what}: {e}"
                    self.errors.append(msg)
                    print(f"netpager cleanup: {msg}", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
            with _lock:
                if self in _live:
                    _live.remove(self)
        finally:
            with _lock:
                _cleaning -= 1
        _redeliver_deferred()
        return list(self.errors)

    def close_or_raise(self) -> None:
        errors = self.close()
        if errors:
            raise CleanupError("; ".join(errors))

    def __enter__(self) -> "Teardown":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_all() -> list[str]:
    """Closes every live Teardown, newest first."""
    errors: list[str] = []
    while True:
        with _lock:
            if not _live:
                break
            td = _live[-1]
        errors += td.close()
        with _lock:
            if td in _live:
                _live.remove(td)
    return errors


def _on_signal(signum, _frame) -> None:
    global _handling
    with _lock:
        _deferred.append(signum)
        if _cleaning or _handling:
            return  # acted on once the cleanup under way is done
        _handling = True
    _act_on_signals()


def _redeliver_deferred() -> None:
    """Acts on signals that arrived during an ordinary cleanup."""
    global _handling
    with _lock:
        if _cleaning or _handling or not _deferred:
            return
        _handling = True
    _act_on_signals()


def _act_on_signals() -> None:
    """Undoes everything, then ends as the signals ask: SIGINT raises
    KeyboardInterrupt, SIGTERM/SIGHUP kill the process with that signal so
    its parent sees the usual status."""
    global _handling
    try:
        name = signal.Signals(_deferred[0]).name
        print(f"netpager cleanup: {name}: undoing everything", file=sys.stderr, flush=True)
        close_all()
    finally:
        with _lock:
            received = list(_deferred)
            _deferred.clear()
            _handling = False
    fatal = [s for s in received if s != signal.SIGINT]
    if fatal:
        signal.signal(fatal[0], signal.SIG_DFL)
        os.kill(os.getpid(), fatal[0])
    raise KeyboardInterrupt


def install_handlers() -> None:
    """atexit + signal handlers that close every live Teardown (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _on_signal)
