"""`proxy/dedupe.SeenFrames`: which (origin, seq) frames ingest takes as already stored."""

from __future__ import annotations

import pytest

from tensorverse.proxy.dedupe import SeenFrames


def test_a_stored_frame_is_seen_and_origins_never_clash():
    seen = SeenFrames(window=16)
    for s in (1, 2, 3):
        seen.add(7, s)
    assert [(7, s) in seen for s in range(0, 6)] == [False, True, True, True, False, False]
    assert (8, 2) not in seen  # another capturing process, the same seq
    seen.add(7, 5)  # a gap: 4 was never stored
    assert (7, 4) not in seen and (7, 5) in seen and (7, 3) in seen


def test_the_window_ends_exactly_window_seqs_below_the_highest():
    seen = SeenFrames(window=16)
    for s in range(1, 21):
        seen.add(1, s)
    # highest 20: 5..20 are within the window, 4 is a window older
    assert (1, 5) in seen and (1, 4) not in seen and (1, 21) not in seen
    seen.add(1, 3)  # below the window: not kept
    assert (1, 3) not in seen


def test_a_slot_reused_by_the_moving_window_forgets_the_older_seq():
    seen = SeenFrames(window=16)
    seen.add(1, 2)
    seen.add(1, 17)  # 2 and 18 share a slot; 18 was never stored
    assert (1, 2) in seen and (1, 17) in seen
    seen.add(1, 19)  # the window moves past 2 and clears the slots of 18 and 19 first
    assert (1, 2) not in seen and (1, 18) not in seen and (1, 19) in seen and (1, 17) in seen
    seen.add(1, 19 + 40)  # a jump of more than a window clears every slot
    assert [(1, s) in seen for s in (17, 19, 59)] == [False, False, True]


def test_the_least_recently_heard_origin_is_forgotten_first():
    seen = SeenFrames(window=8, origins=2)
    seen.add(1, 1)
    seen.add(2, 1)
    seen.add(1, 2)  # origin 1 heard again: origin 2 is now the oldest
    seen.add(3, 1)
    assert len(seen) == 2 and (2, 1) not in seen and (1, 1) in seen and (3, 1) in seen
    assert seen.nbytes() == 2 * 8 // 8


def test_a_window_must_be_whole_bytes_and_origins_at_least_one():
    for bad in (0, 12, -8):
        with pytest.raises(ValueError):
            SeenFrames(window=bad)
    with pytest.raises(ValueError):
        SeenFrames(origins=0)
