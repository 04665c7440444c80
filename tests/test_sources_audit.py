"""Camera and state sources as a robot wires them: frames a policy cannot take, readings dated on
another clock, and OpenCV sources on a machine without OpenCV."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from phyai_edge.control.cameras import OpenCVCamera, ZmqCamera
from phyai_edge.control.config import CameraConfig, ConfigError, StateConfig
from phyai_edge.control.fakes import free_tcp_endpoint
from phyai_edge.control.protocol import FrameMessage, StateMessage
from phyai_edge.control.state import ZmqState


class _Frames:
    """A capture serving one frame over and over (OpenCV's grab / retrieve)."""

    def __init__(self, image: np.ndarray) -> None:
        self.image = image

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return True

    def grab(self) -> bool:
        time.sleep(0.002)
        return True

    def retrieve(self) -> tuple[bool, np.ndarray]:
        return True, self.image

    def get(self, prop: int) -> float:
        return 0.0

    def set(self, *args: Any) -> bool:
        return True

    def release(self) -> None:
        pass


@pytest.mark.parametrize("shape", [(24, 32), (24, 32, 4), (24, 32, 3)])
def test_a_16_bit_frame_is_refused_by_the_camera_not_by_every_inference(shape, caplog):
    """A GStreamer pipeline ending in GRAY16_LE (a depth or thermal camera) gives 16-bit frames:
    the gray and BGRA ones came out of the conversion as 16-bit BGR, the camera counted as
    connected and every inference failed on the dtype. The camera must refuse them and say why."""
    pytest.importorskip("cv2")
    cam = OpenCVCamera(CameraConfig("top", source="gstreamer", pipeline="x"),
                       open_capture=lambda cfg: _Frames(np.zeros(shape, np.uint16)), backoff_s=(0.05, 0.05))
    with caplog.at_level("WARNING", logger="phyai_edge.control"):
        cam.start()
        try:
            time.sleep(0.3)
            delivered, connected = cam.latest(), cam.connected
        finally:
            cam.stop()
    assert delivered is None and not connected
    assert any("unsupported frame" in r.getMessage() and "uint16" in r.getMessage() for r in caplog.records)


def test_an_opencv_source_without_opencv_fails_at_start_not_by_holding_forever(monkeypatch):
    """Without the `camera` extra the capture thread retried the import for ever while the daemon
    held STALE; the start (before the clock runs, and in preflight) must refuse, naming the fix."""
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 raises ImportError
    cam = OpenCVCamera(CameraConfig("wrist", source="v4l2"))
    with pytest.raises(ConfigError, match=r"cameras\.wrist: .*needs OpenCV.*phyai-edge\[camera\]"):
        cam.start()
    assert cam._thread is None


@pytest.mark.parametrize("device, fix", [("0", "device = 0, a number"), ("video2", '"/dev/video2"'),
                                         ("", '"/dev/video0"')])
def test_a_v4l2_device_string_that_is_not_a_path_is_refused_when_the_config_is_read(device, fix):
    """OpenCV opens a string device as a file path, relative to the working directory: `device =
    "0"` (a quoted index) or "video2" never named the camera, the capture thread retried it for
    ever and the daemon held STALE. Refused when read, with the spelling that works."""
    from phyai_edge.control.config import parse_config

    with pytest.raises(ConfigError, match=rf"^cameras\.top\.device: .*not a device path.*write {fix}"):
        parse_config({"cameras": {"top": {"source": "v4l2", "device": device}}})
    for ok in (0, "/dev/video0", "/dev/v4l/by-id/usb-cam-video-index0"):
        assert parse_config({"cameras": {"top": {"source": "v4l2", "device": ok}}}).cameras["top"].device == ok


def _joined(pub: Any, send: Callable[[], None], latest: Callable[[], Any]) -> Any:
    """Resend until the SUB has joined and one reading came through; that reading."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        send()
        time.sleep(0.02)
        got = latest()
        if got is not None:
            return got
    raise AssertionError("nothing arrived")


def _after(send: Callable[[], None], latest: Callable[[], Any]) -> Any:
    send()
    time.sleep(0.1)
    return latest()


@contextlib.contextmanager
def _top_camera() -> Iterator[tuple[Any, ZmqCamera]]:
    """A PUB bound here and the ZeroMQ camera "top" reading it, both closed after."""
    ctx = zmq.Context()
    endpoint = free_tcp_endpoint()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    cam = ZmqCamera(CameraConfig("top", source="zmq", endpoint=endpoint), ctx)
    cam.start()
    try:
        yield pub, cam
    finally:
        cam.stop()
        ctx.destroy(linger=0)


def test_an_empty_frame_over_zeromq_is_refused_and_the_last_good_one_ages():
    """A sender whose camera failed may still send a 0 x 0 frame: taken, it counted as a fresh
    frame and the policy ran on nothing; refused, the last good frame ages into STALE."""
    with _top_camera() as (pub, cam):
        good = _joined(pub, lambda: pub.send(FrameMessage("top", np.zeros((4, 6, 3), np.uint8), 1,
                                                          time.monotonic_ns()).encode()), cam.latest)
        for shape in [(0, 0, 3), (0, 6, 3), (4, 0, 3)]:
            got = _after(lambda shape=shape: pub.send(FrameMessage("top", np.zeros(shape, np.uint8), 2,
                                                                   time.monotonic_ns()).encode()), cam.latest)
            assert got is good, f"a {shape} frame was taken"
        assert cam.bad_messages == 3


def test_a_gray_frame_over_zeromq_is_not_copied_on_the_clock_thread():
    """`latest()` runs on the clock thread, before the tick publishes: a GRAY8 frame was repeated
    into three channels there (np.repeat, 4 ms for a 1080p frame, 12 ms at worst). The policy
    must still get three equal channels, in its own contiguous copy made by the worker."""
    import tracemalloc

    from phyai_edge.control.protocol import PIXEL_GRAY8
    from phyai_edge.control.worker import as_policy_frame

    gray = np.arange(480 * 640, dtype=np.uint32).astype(np.uint8).reshape(480, 640, 1)
    with _top_camera() as (pub, cam):

        def send() -> None:
            pub.send(FrameMessage("top", gray, 1, time.monotonic_ns(), pixel_format=PIXEL_GRAY8).encode())

        _joined(pub, send, cam.latest)
        send()
        time.sleep(0.1)
        tracemalloc.start()
        try:
            fr = cam.latest()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert fr is not None and fr.seq == 1
        assert peak < gray.nbytes, f"latest() allocated {peak} bytes for a {gray.nbytes}-byte gray frame"
        seen = as_policy_frame(fr.image, fr.bgr, None)
        assert seen.shape == (480, 640, 3) and seen.flags.c_contiguous and seen.flags.writeable
        np.testing.assert_array_equal(seen, np.repeat(gray, 3, axis=-1))


@pytest.mark.parametrize("clock", ["monotonic", "realtime"])
@pytest.mark.parametrize("stamp", ["zero", "other host"])
def test_readings_dated_on_another_clock_are_named_with_the_key_that_fixes_them(clock, stamp, caplog):
    """A sender that leaves the header time at 0, or stamps with another host's clock, makes every
    reading stale on arrival: the daemon held STALE on every tick, saying only "stale (state)".
    The source must say the likely cause and the clock key, once (not per message)."""
    ctx = zmq.Context()
    endpoints = free_tcp_endpoint(), free_tcp_endpoint()
    pubs = [ctx.socket(zmq.PUB) for _ in endpoints]
    for pub, endpoint in zip(pubs, endpoints):
        pub.bind(endpoint)
    state = ZmqState(StateConfig("zmq", endpoints[0], clock), 6, ctx)
    cam = ZmqCamera(CameraConfig("top", source="zmq", endpoint=endpoints[1], clock=clock), ctx)
    state.start()
    cam.start()

    def times() -> tuple[int, int]:
        if stamp == "zero":
            return 0, 0
        return time.monotonic_ns() - 3600 * 10**9, time.time_ns() - 3600 * 10**9  # an hour behind

    def send_state() -> None:
        pubs[0].send(StateMessage(np.zeros(6, np.float32), 1, *times()).encode())

    def send_frame() -> None:
        pubs[1].send(FrameMessage("top", np.zeros((4, 4, 3), np.uint8), 1, *times()).encode())

    try:
        with caplog.at_level("WARNING", logger="phyai_edge.control"):
            _joined(pubs[0], send_state, state.latest)
            _joined(pubs[1], send_frame, cam.latest)
            for _ in range(3):
                _after(send_state, state.latest)
                _after(send_frame, cam.latest)
    finally:
        state.stop()
        cam.stop()
        ctx.destroy(linger=0)
    lines = [r.getMessage() for r in caplog.records if "old on arrival" in r.getMessage()]
    fix = '"realtime"' if clock == "monotonic" else '"receive"'
    for key in ("state.clock", "cameras.top.clock"):
        said = [line for line in lines if key in line]
        assert len(said) == 1, lines
        assert fix in said[0], said[0]
        assert ("at 0" in said[0]) == (stamp == "zero"), said[0]


def test_a_sender_on_the_same_clock_is_not_warned_about(caplog):
    ctx = zmq.Context()
    endpoint = free_tcp_endpoint()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    state = ZmqState(StateConfig("zmq", endpoint, "monotonic"), 6, ctx)
    state.start()
    try:
        with caplog.at_level("WARNING", logger="phyai_edge.control"):
            _joined(pub, lambda: pub.send(StateMessage(np.zeros(6, np.float32), 1, time.monotonic_ns()).encode()),
                    state.latest)
    finally:
        state.stop()
        ctx.destroy(linger=0)
    assert state.old_on_arrival == 0 and not caplog.records


class _SeesPixels:
    """A FakePolicy that keeps the first pixel of every camera image each inference took."""

    def __init__(self, **kwargs: Any) -> None:
        from phyai_edge.control.fakes import FakePolicy

        self.policy = FakePolicy(**kwargs)
        self.pixels: list[dict[str, list[int] | None]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def infer(self, observations: list[Any], rtc: Any = None, noise: Any = None) -> Any:
        self.pixels.append({name: None if img is None else img[0, 0].tolist()
                            for name, img in observations[0].images.items()})
        return self.policy.infer(observations, rtc, noise)


class _Pluggable(_Frames):
    """A USB camera on a cable: `plugged` cleared, an open fails and so does every read."""

    def __init__(self, image: np.ndarray, plugged: Any) -> None:
        super().__init__(image)
        self.plugged = plugged
        self.opened = plugged.is_set()

    def isOpened(self) -> bool:  # noqa: N802 - OpenCV's name
        return self.opened

    def grab(self) -> bool:
        time.sleep(0.01)
        return self.plugged.is_set()


def test_every_source_reaches_the_policy_in_rgb_and_an_unplugged_camera_holds_until_it_is_back():
    """Colour order from each source to the policy (OpenCV gives BGR; ZeroMQ frames say their
    format), then a USB camera unplugged mid-run: the daemon holds STALE instead of reusing its
    last frame, and runs the policy again once the camera is plugged back."""
    import threading

    from test_control_daemon import Running

    from phyai_edge.control.daemon import Daemon
    from phyai_edge.control.fakes import test_config
    from phyai_edge.control.protocol import PIXEL_BGR8, PIXEL_GRAY8, PIXEL_RGB8, Flag

    bgr = np.zeros((8, 8, 3), np.uint8)
    bgr[..., 0], bgr[..., 1], bgr[..., 2] = 10, 20, 30  # blue 10, green 20, red 30 as OpenCV stores them
    plugged = threading.Event()
    plugged.set()
    usb = OpenCVCamera(CameraConfig("top", source="v4l2"), open_capture=lambda cfg: _Pluggable(bgr, plugged),
                       backoff_s=(0.05, 0.1))
    ctx = zmq.Context()
    endpoint = free_tcp_endpoint()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    zmq_cams = {name: ZmqCamera(CameraConfig(name, source="zmq", endpoint=endpoint), ctx) for name in ("rgb", "bgr", "gray")}
    sent = {"rgb": (PIXEL_RGB8, np.array([10, 20, 30], np.uint8)), "bgr": (PIXEL_BGR8, np.array([10, 20, 30], np.uint8)),
            "gray": (PIXEL_GRAY8, np.array([40], np.uint8))}
    stop = threading.Event()

    def camera_host() -> None:
        seq = 0
        while not stop.is_set():
            for name, (fmt, pixel) in sent.items():
                image = np.broadcast_to(pixel, (8, 8, pixel.size))
                pub.send(FrameMessage(name, image, seq, time.monotonic_ns(), pixel_format=fmt).encode())
            seq += 1
            time.sleep(0.02)

    host = threading.Thread(target=camera_host, daemon=True)
    host.start()
    policy = _SeesPixels(action_dim=6, state_dim=6, camera_names=("top", "rgb", "bgr", "gray"), latency_s=0.01)
    run = Running(Daemon(test_config(), policy=policy, cameras={"top": usb, **zmq_cams}, realtime=False))  # type: ignore[arg-type]
    try:
        def policy_actions() -> int:
            return sum(1 for h, _ in run.actions() if not h.flags & Flag.HOLD)

        run.wait_for(lambda: policy_actions() >= 20, what="policy actions from every camera")
        first = next(p for p in policy.pixels if all(v is not None for v in p.values()))
        assert first == {"top": [30, 20, 10], "rgb": [10, 20, 30], "bgr": [30, 20, 10], "gray": [40, 40, 40]}

        plugged.clear()
        pulled = len(run.actions())
        run.wait_for(lambda: any(h.flags & Flag.STALE for h, _ in run.actions()[pulled:]), what="STALE after unplug")
        inferences = policy.calls
        time.sleep(0.5)
        run.wait_for(lambda: True, 0.1)
        held = run.actions()[-10:]
        assert all(h.flags & Flag.HOLD and h.flags & Flag.STALE for h, _ in held), "acted on a frame of a camera unplugged"
        assert policy.calls <= inferences + 1, "inference kept running on the unplugged camera's last frame"

        plugged.set()
        back = len(run.actions())
        run.wait_for(lambda: sum(1 for h, _ in run.actions()[back:] if not h.flags & Flag.HOLD) >= 10,
                     what="policy actions after the camera is back")
        assert usb.reconnects >= 1 and usb.connected
    finally:
        stop.set()
        run.stop()
        host.join(2)
        ctx.destroy(linger=0)


def test_a_refused_state_message_still_carries_its_estop_once_a_good_sample_came():
    """What protocol.md says of refused state messages: a wrong width or NaN / Inf is refused and
    counted; its ESTOP bit holds the daemon (as ESTOP) when a valid sample came before it."""
    from phyai_edge.control.protocol import STATE_FLAG_ESTOP

    ctx = zmq.Context()
    endpoint = free_tcp_endpoint()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    state = ZmqState(StateConfig("zmq", endpoint), 6, ctx)
    state.start()
    try:
        good = _joined(pub, lambda: pub.send(StateMessage(np.ones(6, np.float32), 1, time.monotonic_ns()).encode()),
                       state.latest)
        wide = _after(lambda: pub.send(StateMessage(np.ones(7, np.float32), 2, time.monotonic_ns()).encode()),
                      state.latest)
        assert wide is good and state.bad_messages == 1
        nan = np.full(6, np.nan, np.float32)
        held = _after(lambda: pub.send(StateMessage(nan, 3, time.monotonic_ns(), flags=STATE_FLAG_ESTOP).encode()),
                      state.latest)
        assert held.estop and held.seq == 1 and np.isfinite(held.values).all() and state.bad_messages == 2
    finally:
        state.stop()
        ctx.destroy(linger=0)
