"""Logging for a daemon on stdout: one line per event, journald priorities when under systemd.

Under systemd (stdout is the stream JOURNAL_STREAM names) each line starts with `<N>`
(sd-daemon(3) priority prefixes) and carries no timestamp (journald adds one). On a terminal or in
a file: an ISO-ish timestamp and the level. Never colours.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class JournalFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        text = record.getMessage()
        if record.exc_info:
            text += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        return f"<{prio}>{text}".replace("\n", " ")


class LineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03d %(levelname)-7s %(message)s", "%Y-%m-%dT%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


class _StatusAwareHandler(logging.StreamHandler):
    """Clears a live status line (see status.py) before writing a log line on a terminal."""

    clear_line = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.clear_line:
            with contextlib.suppress(Exception):
                sys.stderr.write("\r\033[K")
        super().emit(record)


def under_journald(stream: Any = None) -> bool:
    """Whether `stream` (default stdout) is the journal stream systemd connected this process to.

    JOURNAL_STREAM holds that stream's "device:inode" (systemd.exec(5)); it is inherited by every
    process started from a service (a shell, tmux, a script redirecting to a file), so its mere
    presence does not mean our output goes to the journal: the file descriptor must match.
    """
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((sys.stdout if stream is None else stream).fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """sys.excepthook under journald: the traceback as one CRITICAL entry, not one INFO entry per line."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("phyai_edge").critical("uncaught %s: %s", exc_type.__name__, exc, exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: Any) -> None:
    """threading.excepthook under journald: a helper thread that died, as one ERROR entry."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("phyai_edge").error("thread %s died: uncaught %s: %s", name, args.exc_type.__name__,
                                          args.exc_value, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def worth_logging(count: int) -> bool:
    """For a failure that can repeat every period for hours (a camera left unplugged, a full
    disk): log its 1st, 10th, 100th, ... occurrence."""
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


# The levels the commands' --log-level takes (their logging module names, lower case).
LOG_LEVELS = ("debug", "info", "warning", "error")
_CONFIGURED: list[tuple[int, bool]] = []  # `setup_logging`'s last (level, to_stderr), for child processes


def configured_level() -> int | None:
    """The level `setup_logging` set in this process (None: it was not called, e.g. a library
    user or a test): what a worker process repeats so that its lines reach the journal alike."""
    return _CONFIGURED[-1][0] if _CONFIGURED else None


def configured_to_stderr() -> bool:
    """Whether `setup_logging` sent the lines to stderr (stdout then carries a JSON summary)."""
    return bool(_CONFIGURED) and _CONFIGURED[-1][1]


def setup_logging(level: int = logging.INFO, to_stderr: bool = False) -> logging.Handler:
    """The daemon's log lines on stdout (the journal's stream), or on stderr where stdout carries
    something else (`run --summary -`, whose JSON would be mixed with them)."""
    _CONFIGURED[:] = [(level, to_stderr)]
    handler = _StatusAwareHandler(sys.stderr if to_stderr else sys.stdout)
    journal = under_journald()
    handler.setFormatter(JournalFormatter() if journal else LineFormatter())
    if journal:
        # Python prints uncaught tracebacks on stderr, one journal entry per line at the default
        # priority (info): `journalctl -p warning` would not show them, and they interleave with
        # other lines. Route them through the logger instead.
        import threading

        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    root = logging.getLogger("phyai_edge")
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    return handler
