"""Wire format round trips (docs/protocol.md)."""

from __future__ import annotations

import numpy as np
import pytest

from phyai_edge.control import protocol as p


def test_action_round_trip():
    values = np.arange(14, dtype=np.float32)[None] * 0.25
    h = p.ActionHeader(seq=2**40 + 3, publish_mono_ns=123, publish_wall_ns=-5, obs_mono_ns=99, chunk_id=7,
                       index=12, rows=1, dim=14, flags=p.Flag.HOLD | p.Flag.CLAMPED, session=0xDEADBEEF,
                       instruction=2**32 - 2)
    frames = p.encode_actions(b"action", h, values)
    assert len(frames) == 3 and len(frames[1]) == p.ACTION_HEADER_SIZE == 64
    assert len(frames[2]) == 14 * 4
    topic, h2, v2 = p.decode_actions(frames)
    assert topic == b"action" and h2 == h
    np.testing.assert_array_equal(v2, values)
    # Fixed offsets the C example relies on.
    assert frames[1][:4] == b"PHYA"
    assert int.from_bytes(frames[1][16:24], "little") == h.seq
    assert int.from_bytes(frames[1][8:12], "little") == int(p.Flag.HOLD | p.Flag.CLAMPED)
    assert int.from_bytes(frames[1][56:58], "little") == 14
    assert int.from_bytes(frames[1][60:64], "little") == h.instruction  # the u32 version 1 had reserved
    assert frames[1][58:60] == b"\0\0"  # still reserved


def test_chunk_round_trip():
    rows = np.random.default_rng(0).standard_normal((38, 6)).astype(np.float32)
    h = p.ActionHeader(seq=5, publish_mono_ns=1, publish_wall_ns=2, obs_mono_ns=3, chunk_id=4, index=12, rows=38,
                       dim=6, kind=p.KIND_CHUNK)
    _, h2, v2 = p.decode_actions(p.encode_actions(b"chunk", h, rows))
    assert h2.kind == p.KIND_CHUNK and h2.rows == 38
    np.testing.assert_array_equal(v2, rows)


def test_bad_action_messages_are_rejected():
    h = p.ActionHeader(seq=0, publish_mono_ns=0, publish_wall_ns=0, obs_mono_ns=0, chunk_id=0, index=0, rows=1, dim=3)
    frames = p.encode_actions(b"a", h, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="magic"):
        p.decode_actions([frames[0], b"XXXX" + frames[1][4:], frames[2]])
    with pytest.raises(ValueError, match="header says"):
        p.decode_actions([frames[0], frames[1], frames[2][:8]])
    bumped = bytearray(frames[1])
    bumped[4] = 9
    with pytest.raises(ValueError, match="version"):
        p.decode_actions([frames[0], bytes(bumped), frames[2]])


def test_state_round_trip():
    m = p.StateMessage(np.linspace(-1, 1, 14, dtype=np.float32), seq=9, mono_ns=10**12, wall_ns=2, flags=p.STATE_FLAG_ESTOP)
    raw = m.encode()
    assert raw[:4] == b"PHYS" and len(raw) == p.STATE_HEADER_SIZE + 14 * 4
    m2 = p.StateMessage.decode(raw)
    assert (m2.seq, m2.mono_ns, m2.wall_ns, m2.flags) == (9, 10**12, 2, p.STATE_FLAG_ESTOP)
    np.testing.assert_array_equal(m2.values, m.values)
    with pytest.raises(ValueError, match="header says"):
        p.StateMessage.decode(raw[:-4])


def test_frame_round_trip_and_topic():
    img = np.random.default_rng(1).integers(0, 255, (6, 8, 3), dtype=np.uint8)
    m = p.FrameMessage("top", img, seq=3, capture_mono_ns=77, capture_wall_ns=88, pixel_format=p.PIXEL_BGR8)
    raw = m.encode()
    assert raw.startswith(p.frame_topic("top")) and not raw.startswith(p.frame_topic("top2"))
    m2 = p.FrameMessage.decode(raw)
    assert (m2.camera, m2.seq, m2.capture_mono_ns, m2.pixel_format) == ("top", 3, 77, p.PIXEL_BGR8)
    np.testing.assert_array_equal(m2.image, img)
    with pytest.raises(ValueError, match="longer than"):
        p.frame_topic("x" * 25)


def test_listener_counts_a_repeat_once_and_no_false_gap_after_it():
    from phyai_edge.control.fakes import free_tcp_endpoint
    from phyai_edge.control.listener import Listener

    lis = Listener(free_tcp_endpoint())
    try:
        for seq in (0, 1, 2, 3, 4, 5, 2, 6, 7, 7, 9):  # a step back to 2, a duplicate 7, 8 lost
            h = p.ActionHeader(seq=seq, publish_mono_ns=1, publish_wall_ns=1, obs_mono_ns=0, chunk_id=0, index=0,
                               rows=1, dim=2, session=42)
            lis.handle(p.encode_actions(b"action", h, np.zeros((1, 2), np.float32)), 2, 2)
        st = lis.stats
        assert (st.repeats, st.gaps, st.last_seq) == (2, 1, 9)
    finally:
        lis.close()


@pytest.mark.parametrize("shape", [(2, 7), (1, 14)])
def test_a_state_of_more_or_less_than_one_row_is_refused_by_the_sender(shape):
    """A (2, 7) array was flattened into 14 values without a word."""
    with pytest.raises(ValueError, match=r"state message: values of shape .*send one row"):
        p.StateMessage(np.zeros(shape, np.float32), seq=1, mono_ns=1).encode()
