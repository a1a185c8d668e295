"""Event batching is a setting of each watch, not of the process (``files.inotify``)."""

from __future__ import annotations

from pathlib import Path

from hidden_state_reader.files.inotify import Inotify
from hidden_state_reader.read.sources import FollowSource

from samples import write_samples


def _window(source: FollowSource) -> float:
    assert source._watch is not None
    return Inotify.batch_window(source._watch)


def test_two_watchers_in_one_process_keep_their_own_windows(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    group = FollowSource(str(tmp_path / "a"), rescan_interval=3600)
    alone = FollowSource(str(tmp_path / "b"), rescan_interval=3600)
    try:
        assert group.watching and alone.watching
        group.set_batch_window(0.1)  # a follower of a group of 16
        assert (_window(group), _window(alone)) == (0.1, 0.0)
        # The shared thread waits only as long as the most impatient watch allows.
        assert Inotify._batch_window == 0.0
        # Events still reach both watches, each its own.
        write_samples(tmp_path / "a", 1, prefix="a_")
        write_samples(tmp_path / "b", 1, prefix="b_")
        assert group.next(timeout=30) == "a_0.safetensors"
        assert alone.next(timeout=30) == "b_0.safetensors"
        alone.close()
        # At most the batching watch's window (other tests' watches may still be live).
        assert Inotify._batch_window <= 0.1
        group.set_batch_window(0.0)  # its group shrank to one member
        assert _window(group) == 0.0 and Inotify._batch_window == 0.0
    finally:
        group.close()
        alone.close()
    assert Inotify._batch_window == 0.0


def test_two_watchers_of_one_directory_keep_their_own_windows(tmp_path: Path) -> None:
    first = FollowSource(str(tmp_path), rescan_interval=3600)
    second = FollowSource(str(tmp_path), rescan_interval=3600)
    try:
        first.set_batch_window(0.05)
        second.set_batch_window(0.2)
        assert (_window(first), _window(second)) == (0.05, 0.2)
        assert Inotify._batch_window <= 0.05  # the most impatient watch of the process
        first.close()
        assert _window(second) == 0.2 and Inotify._batch_window <= 0.2
    finally:
        first.close()
        second.close()


def test_a_group_follower_batches_its_own_watch_only(tmp_path: Path) -> None:
    from hidden_state_reader.files.flockwait import CancelToken
    from hidden_state_reader.options import LoadOptions
    from hidden_state_reader.read.claims import ClaimStore
    from hidden_state_reader.read.decision import GROUP_BATCH_WINDOW, Decider
    from hidden_state_reader.read.membership import Membership
    from hidden_state_reader.read.stream import CompletionStream

    shared, own = tmp_path / "shared", tmp_path / "own"
    shared.mkdir()
    own.mkdir()
    claims = ClaimStore(str(shared), "g")
    claims_root = str(shared / ".claims")
    members = [Membership(claims_root, "g", f"member-{i}") for i in range(4)]
    for member in members:
        member.join()
    grouped = FollowSource(str(shared), rescan_interval=3600)
    alone = FollowSource(str(own), rescan_interval=3600)
    decider = Decider(str(shared), LoadOptions(), claims=claims, membership=members[0])
    stream = CompletionStream(grouped, decider, CancelToken(), lock_timeout=None)
    try:
        stream._gather()  # the group is seen: the follower sets its watch's window
        assert _window(grouped) == 4 * GROUP_BATCH_WINDOW[0]
        assert _window(alone) == 0.0  # another reader of the process is untouched
        assert Inotify._batch_window == 0.0
    finally:
        grouped.close()
        alone.close()
        for member in members:
            member.leave()
