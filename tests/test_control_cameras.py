"""Camera sources: OpenCV reconnect with backoff, video files, the synthetic source; the ZeroMQ
camera and state sources' sample times."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from phyai_edge.control.cameras import OpenCVCamera, SyntheticCamera, ZmqCamera
from phyai_edge.control.config import CameraConfig, StateConfig
from phyai_edge.control.fakes import free_tcp_endpoint
from phyai_edge.control.protocol import FrameMessage, StateMessage
from phyai_edge.control.state import ZmqState


class _CaptureProps:
    """What OpenCVCamera asks of a capture besides frames: no properties, settings accepted."""

    def get(self, prop: int) -> float:
        return 0.0

    def set(self, *args) -> bool:
        return True

    def release(self) -> None:
        pass


class FlakyCapture(_CaptureProps):
    """Opens on the 2nd try, delivers `frames` frames, then its reads fail (unplugged)."""

    opens = 0

    def __init__(self, frames: int) -> None:
        FlakyCapture.opens += 1
        self.ok = FlakyCapture.opens >= 2
        self.left = frames

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return self.ok

    def grab(self) -> bool:
        time.sleep(0.002)
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def retrieve(self):
        return True, np.zeros((4, 4, 3), np.uint8)


def test_opencv_camera_reconnects_with_backoff():
    FlakyCapture.opens = 0
    cam = OpenCVCamera(CameraConfig("top", source="v4l2"), open_capture=lambda cfg: FlakyCapture(5), backoff_s=(0.01, 0.04))
    cam.start()
    try:
        end = time.monotonic() + 5
        while FlakyCapture.opens < 4 and time.monotonic() < end:
            time.sleep(0.01)
        assert FlakyCapture.opens >= 4, "did not keep reconnecting"
        fr = cam.latest()
        assert fr is not None and fr.bgr and fr.seq >= 5
        # Seq keeps growing across reconnects: each reconnect delivered new frames.
        seq = fr.seq
        end = time.monotonic() + 5
        while cam.latest().seq == seq and time.monotonic() < end:
            time.sleep(0.01)
        assert cam.latest().seq > seq
        assert cam.reconnects >= 3
    finally:
        cam.stop()


def test_video_file_source_loops_at_its_fps(tmp_path):
    cv2 = pytest.importorskip("cv2")
    path = str(tmp_path / "clip.avi")
    w = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (32, 24))
    for i in range(5):
        w.write(np.full((24, 32, 3), i * 40, np.uint8))
    w.release()
    cam = OpenCVCamera(CameraConfig("top", source="file", path=path, fps=50.0))
    got = threading.Event()
    cam.start()
    try:
        end = time.monotonic() + 5
        while time.monotonic() < end and not got.is_set():
            fr = cam.latest()
            if fr is not None and fr.seq >= 12:  # more frames than the file has: it looped
                got.set()
            time.sleep(0.01)
        assert got.is_set(), "file did not loop"
        fr = cam.latest()
        assert fr.image.shape == (24, 32, 3) and time.monotonic() - fr.capture_s < 0.5
    finally:
        cam.stop()


def test_synthetic_camera_ticks_on_its_fps_grid_and_can_die():
    cam = SyntheticCamera(CameraConfig("top", width=8, height=6, fps=100.0))
    a = cam.latest()
    assert a.image.shape == (6, 8, 3) and a.image.dtype == np.uint8 and not a.image.flags.writeable
    time.sleep(0.03)
    b = cam.latest()
    assert b.seq > a.seq and b.capture_s > a.capture_s
    cam.alive = False
    time.sleep(0.03)
    assert cam.latest() is b


@pytest.mark.parametrize("source", ["state", "camera"])
@pytest.mark.parametrize("clock", ["monotonic", "realtime"])
def test_a_sender_clock_running_ahead_never_dates_a_reading_after_its_arrival(source, clock):
    """A sender 30 s ahead (another host, unsynchronised) must not make its last reading look fresh
    for 30 s after its stream stops: the age check has to see at least the time since arrival."""
    import zmq

    endpoint = free_tcp_endpoint()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    if source == "state":
        reader = ZmqState(StateConfig("zmq", endpoint, clock), 6)
    else:
        reader = ZmqCamera(CameraConfig("top", source="zmq", endpoint=endpoint, clock=clock))
    reader.start()
    ahead_ns = 30 * 10**9
    try:
        got = None
        end = time.monotonic() + 10
        while got is None and time.monotonic() < end:  # resend until the subscription has joined
            mono, wall = time.monotonic_ns() + ahead_ns, time.time_ns() + ahead_ns
            if source == "state":
                pub.send(StateMessage(np.zeros(6, np.float32), 1, mono, wall).encode())
            else:
                pub.send(FrameMessage("top", np.zeros((4, 4, 3), np.uint8), 1, mono, wall).encode())
            time.sleep(0.02)
            got = reader.latest()
        assert got is not None, "nothing arrived"
        taken = got.time_s if source == "state" else got.capture_s
        assert taken <= time.monotonic(), f"dated {taken - time.monotonic():.1f} s in the future"
    finally:
        reader.stop()
        pub.close(0)


class ScriptedCapture(_CaptureProps):
    """A capture that serves `frames` in order (read, or grab + retrieve), then reads fail."""

    def __init__(self, frames: list[np.ndarray]) -> None:
        self.frames = list(frames)
        self.grabbed: np.ndarray | None = None

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return True

    def grab(self) -> bool:
        time.sleep(0.001)
        if not self.frames:
            return False
        self.grabbed = self.frames.pop(0)
        return True

    def retrieve(self):
        return self.grabbed is not None, self.grabbed

    def read(self):
        return (self.retrieve() if self.grab() else (False, None))


def _wait_until(done, timeout_s: float = 10.0) -> None:
    """Poll `done()` every 5 ms until it holds or `timeout_s` passes (the caller's asserts say which)."""
    end = time.monotonic() + timeout_s
    while not done() and time.monotonic() < end:
        time.sleep(0.005)


def _first_frame(cam: OpenCVCamera, timeout_s: float = 10.0):
    _wait_until(lambda: cam.latest() is not None, timeout_s)
    assert cam.latest() is not None, "no frame arrived"
    return cam.latest()


@pytest.mark.parametrize("shape", [(24, 32), (24, 32, 1), (24, 32, 4)])
def test_gray_and_four_channel_opencv_frames_arrive_as_three_channel_bgr(shape):
    """GStreamer pipelines ending in GRAY8 or BGRx give HxW / HxWx4 frames; the policy only takes 3
    channels, so every inference failed. The capture thread converts them (gray replicated, alpha
    dropped) and the frame still says BGR, so the worker's one BGR -> RGB swap is right."""
    pytest.importorskip("cv2")
    image = np.zeros(shape, np.uint8)
    image[..., 0] = 10  # gray value, or B of BGRA
    if len(shape) == 3 and shape[2] == 4:
        image[..., 1], image[..., 2], image[..., 3] = 20, 30, 255
    cam = OpenCVCamera(CameraConfig("top", source="gstreamer"), open_capture=lambda cfg: ScriptedCapture([image] * 3))
    cam.start()
    try:
        fr = _first_frame(cam)
    finally:
        cam.stop()
    assert fr.image.shape == (24, 32, 3) and fr.image.dtype == np.uint8 and fr.bgr
    expected = [10, 10, 10] if len(shape) == 2 or shape[2] == 1 else [10, 20, 30]
    assert fr.image[0, 0].tolist() == expected


def test_a_camera_delivering_another_size_than_configured_is_logged_once(caplog):
    frames = [np.zeros((48, 64, 3), np.uint8)] * 5
    cam = OpenCVCamera(CameraConfig("top", source="v4l2", width=32, height=24),
                       open_capture=lambda cfg: ScriptedCapture(frames), backoff_s=(5.0, 5.0))
    with caplog.at_level("INFO", logger="phyai_edge.control"):
        cam.start()
        try:
            _wait_until(lambda: cam.latest() is not None and cam.latest().seq >= 5)
        finally:
            cam.stop()
    lines = [r.getMessage() for r in caplog.records if "delivers" in r.getMessage()]
    assert lines == ["camera top: delivers 64x48 frames (configured 32x24)"]


class TimedCapture(ScriptedCapture):
    """Each frame comes with an age: `get(CAP_PROP_POS_MSEC)` gives its V4L2 buffer timestamp,
    that long before the grab (None: no timestamp, as FFmpeg and GStreamer give). Decoding
    (retrieve) takes 20 ms and notes when it started."""

    def __init__(self, frames: list[tuple[np.ndarray, float | None]]) -> None:
        super().__init__([image for image, _ in frames])
        self.ages = [age for _, age in frames]
        self.stamp_ms = 0.0
        self.retrieve_started: list[float] = []
        self.exhausted = threading.Event()

    def grab(self) -> bool:
        if not super().grab():
            self.exhausted.set()
            return False
        age = self.ages.pop(0)
        self.stamp_ms = 0.0 if age is None else (time.monotonic() - age) * 1e3
        return True

    def retrieve(self):
        self.retrieve_started.append(time.monotonic())
        time.sleep(0.02)
        return super().retrieve()

    def get(self, prop: int) -> float:
        return self.stamp_ms if prop == 0 else 0.0  # 0: cv2.CAP_PROP_POS_MSEC


def _run_out(cam: OpenCVCamera, cap: TimedCapture):
    """Start `cam`, wait until `cap` has no frame left, stop; the last frame published."""
    cam.start()
    try:
        assert cap.exhausted.wait(10), "the capture thread did not read every frame"
    finally:
        cam.stop()
    return cam.latest()


@pytest.mark.parametrize("source", ["v4l2", "rtsp", "gstreamer"])
def test_a_frame_is_dated_before_its_decode(source):
    """read() is grab + decode; dating a frame after it made it look younger by the decode time."""
    cap = TimedCapture([(np.zeros((4, 4, 3), np.uint8), None)])
    fr = _run_out(OpenCVCamera(CameraConfig("top", source=source), open_capture=lambda cfg: cap,
                               backoff_s=(5.0, 5.0)), cap)
    assert fr is not None and fr.capture_s < cap.retrieve_started[0]


def test_a_v4l2_frame_is_dated_by_its_buffer_timestamp():
    cap = TimedCapture([(np.zeros((4, 4, 3), np.uint8), 0.040)])
    fr = _run_out(OpenCVCamera(CameraConfig("top", source="v4l2"), open_capture=lambda cfg: cap,
                               backoff_s=(5.0, 5.0)), cap)
    assert fr is not None and fr.capture_s == pytest.approx(cap.stamp_ms / 1e3, abs=1e-9)


def test_queued_v4l2_frames_are_skipped_for_the_newest():
    """Three frames the driver queued while the thread was busy (dated 0.5 s ago), then a live one:
    the only frame published is the live one, never an old buffered one."""
    frames = [(np.full((4, 4, 3), i, np.uint8), 0.5) for i in range(3)] + [(np.full((4, 4, 3), 9, np.uint8), 0.001)]
    cap = TimedCapture(frames)
    # 5 fps: the 0.5 s old frames are over two periods old, and a queued frame's 1 ms grab stays far
    # under the half period that would mean "waited for the camera" even on a loaded machine.
    fr = _run_out(OpenCVCamera(CameraConfig("top", source="v4l2", fps=5.0), open_capture=lambda cfg: cap,
                               backoff_s=(5.0, 5.0)), cap)
    assert fr is not None and fr.seq == 1 and int(fr.image[0, 0, 0]) == 9
    assert len(cap.retrieve_started) == 1  # the skipped frames were never decoded


class LaggingStamps(TimedCapture):
    """A camera whose buffer stamps all run 0.5 s behind (a slow transfer, a driver's clock) and
    whose grab waits a frame period for the next frame: nothing is ever queued."""

    def grab(self) -> bool:
        time.sleep(1 / 30)
        return super().grab()


def test_stamps_that_run_behind_do_not_make_the_camera_skip_live_frames():
    """Skipping stops at the first grab that had to wait for the camera: that frame is live. With
    every stamp 0.5 s old, the thread must not grab ten frames (ten periods) for each it uses."""
    frames = [(np.full((4, 4, 3), i, np.uint8), 0.5) for i in range(6)]
    cap = LaggingStamps(frames)
    _run_out(OpenCVCamera(CameraConfig("top", source="v4l2", fps=30.0), open_capture=lambda cfg: cap,
                          backoff_s=(5.0, 5.0)), cap)
    assert len(cap.retrieve_started) == 6  # every grab waited: every frame is live and used


class OpensButNeverReads(ScriptedCapture):
    """A replugged USB camera whose device node opens but whose every read fails."""

    opens = 0

    def __init__(self) -> None:
        super().__init__([])
        OpensButNeverReads.opens += 1


class RecordingEvent(threading.Event):
    """A stop event that notes every wait's timeout (the backoff) and waits 1 ms instead."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return super().wait(0.001)


def test_a_camera_that_opens_but_never_delivers_backs_off_and_logs_rarely(caplog):
    """The backoff was reset by every successful open, so a device node that opens but fails every
    read was reopened every 0.2 s forever, logging 'connected' and 'lost' each time."""
    OpensButNeverReads.opens = 0
    cam = OpenCVCamera(CameraConfig("top", source="v4l2"), open_capture=lambda cfg: OpensButNeverReads(),
                       backoff_s=(0.01, 0.04))
    stop = cam._stop = RecordingEvent()
    with caplog.at_level("INFO", logger="phyai_edge.control"):
        cam.start()
        try:
            _wait_until(lambda: OpensButNeverReads.opens >= 12)
        finally:
            cam.stop()
    assert OpensButNeverReads.opens >= 12
    assert stop.waits[:5] == [0.01, 0.02, 0.04, 0.04, 0.04]
    lines = [r.getMessage() for r in caplog.records if r.name == "phyai_edge.control"]
    assert lines[:2] == ["camera top: read failed (attempt 1); retrying in 0.0 s",
                         "camera top: read failed (attempt 10); retrying in 0.0 s"]
    assert len(lines) == 2 and not cam.connected


def test_a_camera_lost_and_back_logs_once_each_way_and_restarts_its_backoff(caplog):
    """Unplugged after 3 frames, two failed reopens, then frames again: one 'lost', one attempt
    line, one 'connected ... after 2 attempts'; the backoff after the loss starts from the bottom."""
    frame = np.zeros((4, 4, 3), np.uint8)
    script = [[frame] * 3, [], [], [frame] * 2]
    opened = threading.Event()

    def open_capture(cfg):
        cap = ScriptedCapture(script.pop(0) if script else [])
        if not script:
            opened.set()
        return cap

    cam = OpenCVCamera(CameraConfig("top", source="v4l2", width=4, height=4), open_capture=open_capture,
                       backoff_s=(0.01, 0.04))
    stop = cam._stop = RecordingEvent()
    with caplog.at_level("INFO", logger="phyai_edge.control"):
        cam.start()
        try:
            assert opened.wait(10)
            _wait_until(lambda: cam.latest() is not None and cam.latest().seq >= 5)
        finally:
            cam.stop()
    assert cam.latest().seq == 5
    # the loss waits 0.01; the failed attempts 0.01, then 0.02; the second loss 0.01 again
    assert stop.waits[:4] == [0.01, 0.01, 0.02, 0.01]
    lines = [r.getMessage() for r in caplog.records if r.name == "phyai_edge.control"]
    assert lines[0] == "camera top: connected (v4l2 0)"
    assert lines[1] == "camera top: lost (read failed); reconnecting"
    assert lines[2] == "camera top: read failed (attempt 1); retrying in 0.0 s"
    assert lines[3].startswith("camera top: connected (v4l2 0) after 2 attempts, ")


def _write_clip(path: str, frames: int) -> None:
    cv2 = pytest.importorskip("cv2")
    w = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 25, (32, 24))
    for i in range(frames):
        w.write(np.full((24, 32, 3), i * 40, np.uint8))
    w.release()


def test_a_video_file_without_loop_ends_instead_of_playing_again(tmp_path):
    """loop = false went through the reconnect path at the end: the file was reopened and played
    again after the backoff, with a 'lost' warning, so a replay never ended."""
    path = str(tmp_path / "clip.avi")
    _write_clip(path, 3)
    cam = OpenCVCamera(CameraConfig("top", source="file", path=path, fps=200.0, loop=False), backoff_s=(0.01, 0.01))
    cam.start()
    try:
        assert cam._thread is not None
        cam._thread.join(10)
        assert not cam._thread.is_alive(), "the file source did not end"
    finally:
        cam.stop()
    fr = cam.latest()
    assert fr is not None and fr.seq == 3 and cam.reconnects == 0 and not cam.connected


class CannotRewind(ScriptedCapture):
    """A file whose seek does nothing: after its frames, every read fails."""

    opens = 0
    grabs_after_end = 0

    def __init__(self) -> None:
        super().__init__([np.zeros((4, 4, 3), np.uint8)] * 2)
        CannotRewind.opens += 1

    def grab(self) -> bool:
        ok = super().grab()
        CannotRewind.grabs_after_end += not ok
        return ok


def test_a_looping_file_that_cannot_rewind_is_reopened_not_spun_on():
    """The rewind was retried in a busy loop for as long as reads failed (a file that cannot seek:
    a core at 100 % and the GIL contended, the clock thread's included)."""
    CannotRewind.opens = CannotRewind.grabs_after_end = 0
    cam = OpenCVCamera(CameraConfig("top", source="file", path="x", fps=500.0), open_capture=lambda cfg: CannotRewind(),
                       backoff_s=(0.01, 0.01))
    cam.start()
    try:
        _wait_until(lambda: CannotRewind.opens >= 3)
    finally:
        cam.stop()
    assert CannotRewind.opens >= 3 and cam.latest().seq >= 4
    assert CannotRewind.grabs_after_end <= 2 * CannotRewind.opens  # one failed read, one failed rewind per open


class StalledCapture(ScriptedCapture):
    """One frame, then a grab that blocks until `release_read` is set (an RTSP stream that stalls)."""

    def __init__(self) -> None:
        super().__init__([np.zeros((4, 4, 3), np.uint8)])
        self.blocked = threading.Event()
        self.release_read = threading.Event()
        self.released = threading.Event()

    def grab(self) -> bool:
        if self.frames:
            return super().grab()
        self.blocked.set()
        self.release_read.wait(30)
        return False

    def release(self) -> None:
        self.released.set()


def test_stop_does_not_wait_for_a_read_blocked_on_a_stalled_stream(caplog):
    """stop() joined for 2 s, and the daemon's shutdown stops every camera in turn: three stalled
    RTSP cameras kept the process 6 s after its final HOLD. The frame already read goes stale."""
    cap = StalledCapture()
    cam = OpenCVCamera(CameraConfig("top", source="rtsp", url="rtsp://x"), open_capture=lambda cfg: cap)
    cam.start()
    try:
        assert cap.blocked.wait(10), "the read never blocked"
        frame = cam.latest()
        assert frame is not None and frame.seq == 1
        with caplog.at_level("INFO", logger="phyai_edge.control"):
            t0 = time.monotonic()
            cam.stop()
            took = time.monotonic() - t0
        assert took < 1.5, f"stop() waited {took:.2f} s for a blocked read"
        assert "camera top: capture thread still blocked in a read; not waiting for it" in caplog.messages
        assert cam.latest() is frame  # nothing new: its age grows and the daemon counts it stale
    finally:
        cap.release_read.set()
    # When the read returns, the thread releases the capture and ends on its own.
    assert cap.released.wait(10)
    assert cam._thread is not None
    cam._thread.join(10)
    assert not cam._thread.is_alive()


def test_an_rtsp_open_on_a_silent_server_gives_up_after_its_timeout_not_ffmpegs_30_s(monkeypatch):
    """A server that accepts the connection and never answers (a camera hung mid-reboot): FFmpeg's
    default open timeout is 30 s, and so is its read timeout for a stream that stalls (that one
    is passed the same way, next to it)."""
    pytest.importorskip("cv2")
    import socket

    from phyai_edge.control import cameras

    monkeypatch.setattr(cameras, "_RTSP_OPEN_TIMEOUT_MS", 300, raising=False)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    try:
        t0 = time.monotonic()
        cap = cameras._open_opencv(CameraConfig("top", source="rtsp", url=f"rtsp://127.0.0.1:{server.getsockname()[1]}/x"))
        took = time.monotonic() - t0
        assert not cap.isOpened()
        assert took < 15, f"the open took {took:.1f} s"
        assert accepted, "FFmpeg never connected: the test proved nothing"
    finally:
        server.close()
        for conn in accepted:
            conn.close()
