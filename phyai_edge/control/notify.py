"""systemd's sd_notify protocol, written by hand: one datagram on $NOTIFY_SOCKET per message.

No python-systemd dependency. Outside systemd (no NOTIFY_SOCKET) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


def _status_field(text: str) -> str:
    """STATUS=text on one line. The datagram is newline-separated assignments, so a multi-line
    text (a worker's CUDA error in the status) would be cut at its first line, the rest taken
    as assignments of its own."""
    return "STATUS=" + " | ".join(line.strip() for line in text.splitlines() if line.strip())


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        self._addr = ""
        if addr:
            # A leading '@' names a Linux abstract socket (NUL first byte).
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_ok = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        # How often the clock offers a ping: a quarter of the timeout (sd_watchdog_enabled(3) asks
        # for at least every half). The daemon skips an offer after a missed deadline; at half the
        # timeout one skip already made the gap reach WatchdogSec, so a single late tick got the
        # service killed and reloaded. At a quarter it takes three skipped offers in a row (a loop
        # that keeps overrunning) or a clock that stopped ticking.
        self.watchdog_interval_s = int(usec) / 4e6 if watchdog_ok else 0.0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self._addr)
            return True
        except OSError:
            return False  # systemd gone or socket full: never let this stop the clock

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([_status_field(status)] if status else []))

    def extend_timeout(self, seconds: float, status: str = "") -> bool:
        """EXTEND_TIMEOUT_USEC: the current phase (start-up, stop) may run `seconds` from now even
        past TimeoutStartSec= / TimeoutStopSec= (systemd >= 236)."""
        fields = [f"EXTEND_TIMEOUT_USEC={max(1, round(seconds * 1e6))}"]
        return self.notify(*fields, *([_status_field(status)] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.notify(_status_field(text))

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
