"""A live one-line status on a terminal, refreshed twice a second from its own thread.

Only when stderr is a terminal and not under journald; the clock thread just updates numbers.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


class StatusLine:
    def __init__(self, render: Callable[[], str], interval_s: float = 0.5) -> None:
        self._render = render
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def wanted() -> bool:
        import os

        return sys.stderr.isatty() and not os.environ.get("JOURNAL_STREAM")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="status-line", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                sys.stderr.write("\r\033[K" + self._render())
                sys.stderr.flush()
            except Exception:
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
