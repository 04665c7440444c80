"""Camera sources that keep only the newest frame and its capture time.

Every source answers `latest()` with a `Frame` (or None before the first one) without blocking:
the clock thread calls it every tick to check freshness. OpenCV sources (V4L2, GStreamer, RTSP,
video files) read on their own thread and reconnect with backoff; the ZeroMQ source drains its
conflating socket on the caller's thread; the synthetic source needs no thread at all.
OpenCV is imported only when an OpenCV source starts (the `camera` extra).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from phyai_edge.control.config import CameraConfig, ConfigError
from phyai_edge.control.log import worth_logging
from phyai_edge.control.state import ARRIVAL_AGE_WARN_S, arrival_age_hint
from phyai_edge.extras import install_hint

log = logging.getLogger("phyai_edge.control")
# OpenCV logs its own warnings to stderr ("[ WARN:0@0.013] global cap_v4l.cpp ..."), outside the
# daemon's format and without a journald priority; the camera threads say what failed themselves.
# Read when cv2 is first imported; a value the user set wins.
os.environ.setdefault("OPENCV_LOG_LEVEL", "ERROR")


@dataclass(frozen=True)
class Frame:
    image: np.ndarray  # uint8 HxWx3
    capture_s: float  # time.monotonic() seconds when the frame was captured
    seq: int
    bgr: bool = False  # OpenCV delivers BGR; the worker converts off the clock thread


class CameraSource(Protocol):
    name: str

    def start(self) -> None: ...

    def latest(self) -> Frame | None: ...

    def stop(self) -> None: ...

    def describe(self) -> str: ...


# ---------------------------------------------------------------- synthetic


class SyntheticCamera:
    """Moving test pattern on the fps grid. `alive = False` freezes it (tests: a camera that dies)."""

    def __init__(self, cfg: CameraConfig, cycle: int = 32) -> None:
        self.name = cfg.name
        self.fps = cfg.fps
        h, w = cfg.height, cfg.width
        # Precomputed so that latest() is an index, not image synthesis on the clock thread.
        yy, xx = np.mgrid[0:h, 0:w]
        self._frames = []
        for k in range(cycle):
            phase = 2 * np.pi * k / cycle
            r = (127 + 120 * np.sin(xx / max(w, 1) * 6.28 + phase)).astype(np.uint8)
            g = (127 + 120 * np.sin(yy / max(h, 1) * 6.28 - phase)).astype(np.uint8)
            b = np.full((h, w), (k * 255) // cycle, dtype=np.uint8)
            frame = np.stack([r, g, b], axis=-1)
            frame.setflags(write=False)
            self._frames.append(frame)
        self.alive = True
        self._last: Frame | None = None

    def start(self) -> None:
        self.alive = True

    def latest(self) -> Frame | None:
        if self.alive:
            k = int(time.monotonic() * self.fps)
            if self._last is None or self._last.seq != k:
                self._last = Frame(self._frames[k % len(self._frames)], k / self.fps, k)
        return self._last

    def stop(self) -> None:
        pass

    def describe(self) -> str:
        return f"synthetic {self._frames[0].shape[1]}x{self._frames[0].shape[0]} @ {self.fps:g} fps"


# ---------------------------------------------------------------- OpenCV (V4L2, GStreamer, RTSP, file)


# RTSP (FFmpeg) limits: opening, and waiting for the next frame before the stream counts as lost.
_RTSP_OPEN_TIMEOUT_MS = 5000
_RTSP_READ_TIMEOUT_MS = 2000


def _open_opencv(cfg: CameraConfig) -> Any:
    import cv2  # lazily: the `camera` extra

    if cfg.source == "v4l2":
        cap = cv2.VideoCapture(cfg.device, cv2.CAP_V4L2)
    elif cfg.source == "gstreamer":
        cap = cv2.VideoCapture(cfg.pipeline, cv2.CAP_GSTREAMER)
    elif cfg.source == "rtsp":
        # FFmpeg's own limits are 30 s for the open and for each read: a camera that rebooted or a
        # network that dropped held the reconnect back 30 s after the stream was gone (the daemon
        # holding STALE all along), and every open of an unreachable camera took 30 s.
        timeouts = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, _RTSP_OPEN_TIMEOUT_MS, cv2.CAP_PROP_READ_TIMEOUT_MSEC, _RTSP_READ_TIMEOUT_MS]
        try:
            cap = cv2.VideoCapture(cfg.url, cv2.CAP_FFMPEG, timeouts)
        except TypeError:  # OpenCV before 4.5.2 has no constructor with parameters
            cap = cv2.VideoCapture(cfg.url, cv2.CAP_FFMPEG)
    else:
        cap = cv2.VideoCapture(cfg.path)
    if cap.isOpened():
        # Ask for a one-frame queue so read() returns the newest frame; not every backend obeys.
        cap.set(cv2.CAP_PROP_BUFFERSIZE, 1)
        if cfg.source == "v4l2":
            cap.set(cv2.CAP_PROP_FRAME_WIDTH, cfg.width)
            cap.set(cv2.CAP_PROP_FRAME_HEIGHT, cfg.height)
            cap.set(cv2.CAP_PROP_FPS, cfg.fps)
    return cap


def _as_bgr(image: np.ndarray) -> np.ndarray:
    """An OpenCV frame as HxWx3 BGR, converted on the capture thread (cvtColor releases the GIL).
    V4L2 and FFmpeg give BGR already, but a GStreamer pipeline ending in GRAY8 gives HxW frames
    and one ending in BGRx / BGRA (what Jetson's nvvidconv outputs) gives 4 channels: the policy
    takes neither, so every inference on them failed."""
    import cv2

    if image.dtype != np.uint8:
        # Checked first: cvtColor keeps the depth, so a 16-bit gray or BGRA frame (GRAY16_LE, a Y16
        # depth or thermal camera) came out as 16-bit BGR, the camera counted as connected, and the
        # policy refused every frame at inference instead of the camera saying why here.
        raise OSError(f"unsupported frame: shape {image.shape}, {image.dtype} (expected 8-bit gray, BGR or BGRA; "
                      "convert a 16-bit stream to 8 bits in the pipeline)")
    if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 1):
        return cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    if image.ndim == 3 and image.shape[2] == 4:
        return cv2.cvtColor(image, cv2.COLOR_BGRA2BGR)
    if image.ndim == 3 and image.shape[2] == 3:
        return image
    raise OSError(f"unsupported frame: shape {image.shape}, {image.dtype} (expected 8-bit gray, BGR or BGRA)")


# At most this many queued V4L2 frames are skipped for a newer one (OpenCV asks the driver for
# one buffer, but drivers may insist on more; OpenCV's own maximum is 10).
_MAX_QUEUED_FRAMES = 10


class OpenCVCamera:
    """One capture thread; `latest()` reads an attribute the thread replaces (atomic under the GIL)."""

    def __init__(
        self,
        cfg: CameraConfig,
        open_capture: Callable[[CameraConfig], Any] = _open_opencv,
        backoff_s: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        self.name = cfg.name
        self.cfg = cfg
        self._open = open_capture
        self._backoff = backoff_s
        self._latest: Frame | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        self.connected = False

    def start(self) -> None:
        if self._open is _open_opencv:
            try:
                import cv2  # noqa: F401  # only whether it imports
            except ImportError as exc:
                # The capture thread would retry the import forever while the daemon held STALE.
                raise ConfigError(f"cameras.{self.name}: source = {self.cfg.source!r} needs OpenCV, which does not "
                                  f"import ({exc}): {install_hint('cv2')}") from None
        self._thread = threading.Thread(target=self._run, name=f"camera-{self.name}", daemon=True)
        self._thread.start()

    def latest(self) -> Frame | None:
        return self._latest

    def stop(self, join_s: float = 0.25) -> None:
        """Ends the capture thread, waiting at most `join_s` (a read at 4 fps or more returns in
        that). A read blocked on a stalled stream (FFmpeg waits up to its read timeout, 30 s by
        default) is not waited for: the daemon's shutdown stops each camera in turn and must stay
        fast (this waited 2 s per camera). The thread is a daemon thread; it releases the capture
        and ends when its read returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=join_s)
            if self._thread.is_alive():
                log.info("camera %s: capture thread still blocked in a read; not waiting for it", self.name)

    def describe(self) -> str:
        where = {"v4l2": self.cfg.device, "gstreamer": self.cfg.pipeline, "rtsp": self.cfg.url, "file": self.cfg.path}
        return f"{self.cfg.source} {where.get(self.cfg.source, '')}"

    def _next_frame(self, cap: Any, period: float) -> tuple[bool, Any, float]:
        """(ok, image, capture time): grab, date, then decode. read() is grab + retrieve, and dating
        after it made every frame look younger by its decode (an MJPEG or H.264 frame: milliseconds
        to tens of them on an edge CPU)."""
        asked = time.monotonic()
        if not cap.grab():
            return False, None, 0.0
        captured = self._capture_time(cap)
        waited = time.monotonic() - asked > period / 2
        if self.cfg.source == "v4l2" and not waited:
            # Frames the driver queued while this thread was decoding are older than the newest:
            # skip them (a V4L2 grab only dequeues a buffer, the decode is in retrieve). One dated
            # more than two periods ago means a newer one has completed since (the transfer takes
            # at most a period). Only buffer timestamps count: a frame dated at its grab never
            # looks old. A camera slower than configured may have a grab wait for the next frame,
            # never end with an older one. A grab that waited for the camera (more than half a
            # period) found nothing queued: its frame is the newest there is, whatever its stamp
            # says (a driver whose stamps run over two periods behind would otherwise cost up to
            # ten periods a frame).
            for _ in range(_MAX_QUEUED_FRAMES):
                if time.monotonic() - captured <= 2 * period:
                    break
                asked = time.monotonic()
                if not cap.grab():
                    return False, None, 0.0
                captured = self._capture_time(cap)
                if time.monotonic() - asked > period / 2:
                    break
        ok, image = cap.retrieve()
        return ok, image, captured

    def _capture_time(self, cap: Any) -> float:
        """When the grabbed frame was captured, on time.monotonic()'s clock. V4L2 reports the
        driver's buffer timestamp (CLOCK_MONOTONIC in uvcvideo and most drivers: when the frame
        started arriving); it is used when plausible (not ahead of now, under 5 s old). Elsewhere
        CAP_PROP_POS_MSEC is a position in the stream, not a clock, and the grab time is used."""
        now = time.monotonic()
        if self.cfg.source == "v4l2":
            with contextlib.suppress(Exception):
                stamp = float(cap.get(0)) / 1e3  # cv2.CAP_PROP_POS_MSEC
                if 0.0 < stamp <= now and now - stamp < 5.0:
                    return stamp
        return now

    def _run(self) -> None:
        delay = self._backoff[0]
        seq = 0
        is_file = self.cfg.source == "file"
        period = 1.0 / self.cfg.fps
        size = (self.cfg.height, self.cfg.width)  # the last frame size logged
        failures = 0  # attempts since the last frame (each open that gave no frame is one)
        down_since = time.monotonic()
        while not self._stop.is_set():
            cap = None
            got_frame = False
            try:
                cap = self._open(self.cfg)
                if not cap.isOpened():
                    raise OSError("could not open")
                next_t = time.monotonic()
                played = 0  # frames since this file was opened or rewound
                while not self._stop.is_set():
                    ok, image, now = self._next_frame(cap, period)
                    if not ok or image is None:
                        if is_file and played and not self.cfg.loop:
                            # The end of a replay: its last frame goes stale and the daemon holds.
                            # (This went through the reconnect path and played the file again.)
                            log.info("camera %s: end of %s after %d frames (loop = false)", self.name,
                                     self.cfg.path, played)
                            self.connected = False
                            return
                        if is_file and played:
                            # Rewind. A second failure in a row (a file that cannot seek) reopens it
                            # through the reconnect path below instead of rewinding in a busy loop.
                            cap.set(1, 0)  # CAP_PROP_POS_FRAMES: back to the first frame
                            played = 0
                            continue
                        raise OSError("end of file" if is_file else "read failed")
                    played += 1
                    image = _as_bgr(image)
                    if image.shape[:2] != size:
                        # Not an error (the policy resizes any frame), but a camera that ignored the
                        # requested mode costs a larger copy every frame: say so once per change.
                        size = image.shape[:2]
                        log.info("camera %s: delivers %dx%d frames (configured %dx%d)", self.name,
                                 size[1], size[0], self.cfg.width, self.cfg.height)
                    seq += 1
                    self._latest = Frame(image, now, seq, bgr=True)
                    if not got_frame:
                        # Connected means frames, not an open device: a replugged USB camera's node
                        # can open and then fail every read. Only a frame resets the backoff.
                        got_frame, self.connected = True, True
                        log.info("camera %s: connected (%s)%s", self.name, self.describe(),
                                 f" after {failures} attempts, {now - down_since:.1f} s without frames" if failures else "")
                        failures, delay = 0, self._backoff[0]
                    if is_file:  # files read as fast as the disk allows; pace them like a camera
                        next_t += period
                        self._stop.wait(max(0.0, next_t - time.monotonic()))
            except Exception as exc:
                if got_frame:
                    down_since = time.monotonic()
                    log.warning("camera %s: lost (%s); reconnecting", self.name, exc)
                else:
                    failures += 1
                    # A camera left unplugged retries for hours: log the 1st, 10th, 100th... attempt.
                    if worth_logging(failures):
                        log.warning("camera %s: %s (attempt %d); retrying in %.1f s", self.name, exc, failures, delay)
                self.connected = False
            finally:
                if cap is not None:
                    with contextlib.suppress(Exception):
                        cap.release()
            if self._stop.wait(delay):
                break
            self.reconnects += 1
            if not got_frame:
                delay = min(delay * 2, self._backoff[1])


# ---------------------------------------------------------------- ZeroMQ (simulator frames)


class ZmqCamera:
    """SUB with ZMQ_CONFLATE on one camera's topic; drained on the caller's thread (no copy)."""

    def __init__(self, cfg: CameraConfig, context: Any = None) -> None:
        import zmq

        from phyai_edge.control.protocol import frame_topic

        self.name = cfg.name
        self.cfg = cfg
        self._zmq = zmq
        self._ctx = context or zmq.Context.instance()
        self._topic = frame_topic(cfg.topic or cfg.name)
        self._sock: Any = None
        self._latest: Frame | None = None
        self.bad_messages = 0
        self.old_on_arrival = 0  # frames already older than ARRIVAL_AGE_WARN_S when they arrived

    def start(self) -> None:
        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.CONFLATE, 1)  # keep only the newest message (frames are single-part)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        sock.connect(self.cfg.endpoint)
        self._sock = sock

    def latest(self) -> Frame | None:
        from phyai_edge.control.protocol import PIXEL_BGR8, PIXEL_GRAY8, FrameMessage

        zmq = self._zmq
        while self._sock is not None:
            try:
                msg = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            recv_s = time.monotonic()
            try:
                fm = FrameMessage.decode(msg.buffer)
                if fm.image.size == 0:
                    # A sender whose camera failed may still send: taken, the empty frame counted as
                    # fresh and the policy ran on nothing, instead of the camera going stale.
                    raise ValueError(f"frame {fm.seq} is empty ({fm.image.shape[1]}x{fm.image.shape[0]} pixels)")
            except ValueError as exc:
                self.bad_messages += 1
                if self.bad_messages in (1, 10, 100) or self.bad_messages % 1000 == 0:
                    log.warning("camera %s: bad frame message (%s); %d so far", self.name, exc, self.bad_messages)
                continue
            if self.cfg.clock == "monotonic":
                cap_s = fm.capture_mono_ns / 1e9
            elif self.cfg.clock == "realtime":
                cap_s = recv_s - (time.time_ns() - fm.capture_wall_ns) / 1e9
            else:
                cap_s = recv_s
            # Never later than its arrival: a sender whose clock runs ahead would otherwise keep
            # its last frame fresh long after it stopped sending.
            cap_s = min(cap_s, recv_s)
            if recv_s - cap_s > ARRIVAL_AGE_WARN_S:
                self.old_on_arrival += 1
                if worth_logging(self.old_on_arrival):
                    log.warning("camera %s: frame %d was %.1f s old on arrival (%d so far): %s", self.name, fm.seq,
                                recv_s - cap_s, self.old_on_arrival,
                                arrival_age_hint(f"cameras.{self.name}.clock", self.cfg.clock, "capture_mono_ns",
                                                 fm.capture_mono_ns, "capture_wall_ns", fm.capture_wall_ns))
            image = fm.image
            if fm.pixel_format == PIXEL_GRAY8:
                # A read-only view repeating the one channel, not a copy: this runs on the clock
                # thread, where np.repeat of a 1080p frame took 4 ms (12 ms at worst) before the
                # tick could publish. The worker makes its one contiguous copy off the clock.
                image = np.broadcast_to(image, (*image.shape[:2], 3))
            self._latest = Frame(image, cap_s, fm.seq, bgr=fm.pixel_format == PIXEL_BGR8)
        return self._latest

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def describe(self) -> str:
        return f"zmq {self.cfg.endpoint} topic {self.cfg.topic or self.cfg.name}"


def make_camera(cfg: CameraConfig, context: Any = None) -> CameraSource:
    if cfg.source == "synthetic":
        return SyntheticCamera(cfg)
    if cfg.source == "zmq":
        return ZmqCamera(cfg, context)
    return OpenCVCamera(cfg)
