"""Consistent hashing of sample names over a group's members (``read.ownership``)."""

from __future__ import annotations

from collections import Counter

from hidden_state_reader.read.ownership import (
    STAND_INS,
    Ownership,
    Ring,
    Route,
    Turn,
    TurnSchedule,
)

MEMBERS = [f"host-{i}:{1000 + i}:abcd{i:04x}" for i in range(16)]
NAMES = [f"hs_{i}.safetensors" for i in range(20_000)]


def test_every_member_computes_the_same_owner_whatever_the_order_it_lists() -> None:
    a, b = Ring(MEMBERS), Ring(list(reversed(MEMBERS)))
    assert all(a.ranking(n, 3) == b.ranking(n, 3) for n in NAMES[:2000])


def test_shares_are_even_and_rankings_distinct() -> None:
    ring = Ring(MEMBERS)
    owners = Counter(ring.ranking(n, 1)[0] for n in NAMES)
    expected = len(NAMES) / len(MEMBERS)
    assert set(owners) == set(MEMBERS)
    assert max(owners.values()) < 1.35 * expected and min(owners.values()) > 0.65 * expected
    for name in NAMES[:500]:
        ranking = ring.ranking(name, STAND_INS + 1)
        assert len(set(ranking)) == len(ranking) == STAND_INS + 1


def test_a_member_joining_moves_only_its_own_share() -> None:
    before, after = Ring(MEMBERS), Ring([*MEMBERS, "newcomer:1:ffff"])
    moved = [n for n in NAMES if before.ranking(n, 1) != after.ranking(n, 1)]
    assert all(after.ranking(n, 1) == ["newcomer:1:ffff"] for n in moved)
    assert 0.02 < len(moved) / len(NAMES) < 0.12  # about 1/17


def test_owner_acts_at_once_stand_ins_in_turn_everyone_else_last() -> None:
    members = MEMBERS[:8]
    name = NAMES[0]
    ranking = Ring(members).ranking(name, len(members))
    turns = {
        m: Ownership(lambda: members, m, steal_after=2.0).turn(name, now=100.0) for m in members
    }
    assert turns[ranking[0]] == 0.0
    assert [turns[m] for m in ranking[1 : STAND_INS + 1]] == [2.0 * k for k in range(1, 3)]
    assert {turns[m] for m in ranking[STAND_INS + 1 :]} == {2.0 * (STAND_INS + 1)}


def test_a_turn_counts_from_the_first_sight_and_restarts_when_the_data_appears() -> None:
    members = MEMBERS[:4]
    name = NAMES[1]
    stand_in = Ring(members).ranking(name, 2)[1]
    ownership = Ownership(lambda: members, stand_in, steal_after=1.0)
    assert ownership.turn(name, now=10.0) == 1.0
    assert abs(ownership.turn(name, now=10.6) - 0.4) < 1e-9
    assert ownership.turn(name, now=11.5) == 0.0
    assert ownership.first_look_at_data(name) is True  # first sight of its data: wait again
    assert ownership.turn(name) > 0.0
    assert ownership.first_look_at_data(name) is False
    ownership.forget(name)
    assert ownership.turn(name, now=50.0) == 1.0


def test_alone_a_member_owns_everything() -> None:
    ownership = Ownership(lambda: ["me"], "me", steal_after=1.0)
    assert all(ownership.owns(n) and ownership.turn(n) == 0.0 for n in NAMES[:100])


class FakeClock:
    """A clock the test moves by hand (no real time passes)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_schedule_routes_owner_now_stand_ins_later_by_rank() -> None:
    ranking = ["owner", "first", "second"]
    at = {m: TurnSchedule(m, steal_after=2.0).route(ranking, since=10.0, now=10.0) for m in ranking}
    assert at["owner"] == Turn(Route.NOW, 10.0, 0)
    assert at["first"] == Turn(Route.LATER, 12.0, 1)
    assert at["second"] == Turn(Route.LATER, 14.0, 2)
    # The turn comes once the clock reaches it; it counts from ``since``, not ``now``.
    assert TurnSchedule("first", 2.0).route(ranking, since=10.0, now=11.9).route is Route.LATER
    assert TurnSchedule("first", 2.0).route(ranking, since=10.0, now=12.0) == Turn(
        Route.NOW, 12.0, 1
    )
    assert TurnSchedule("first", 2.0).route(ranking, since=10.0, now=11.5).wait(11.5) == 0.5


def test_the_schedule_gives_others_a_last_turn_or_leaves_them_out() -> None:
    ranking = ["owner", "first", "second"]
    directory = TurnSchedule("other", 2.0, others_wait=True)
    store = TurnSchedule("other", 2.0, others_wait=False)
    assert directory.route(ranking, since=0.0, now=0.0) == Turn(Route.LATER, 6.0, 3)
    assert directory.route(ranking, since=0.0, now=6.0) == Turn(Route.NOW, 6.0, 3)
    assert store.route(ranking, since=0.0, now=100.0).route is Route.LEAVE
    # Alone (or before any member is listed), a member owns everything.
    assert store.route([], since=0.0, now=5.0) == Turn(Route.NOW, 5.0, 0)
    assert store.route(["other"], since=0.0, now=5.0) == Turn(Route.NOW, 5.0, 0)


def test_ownership_on_a_fake_clock_counts_turns_from_the_first_sight() -> None:
    members = MEMBERS[:4]
    name = NAMES[1]
    ranking = Ring(members).ranking(name, STAND_INS + 1)
    clock = FakeClock(100.0)
    second = Ownership(lambda: members, ranking[2], steal_after=1.0, clock=clock)
    assert second.route(name) == Turn(Route.LATER, 102.0, 2)
    clock.now = 101.5
    assert second.turn(name) == 0.5  # still from the first sight at 100
    clock.now = 102.0
    assert second.route(name).route is Route.NOW
    assert second.first_look_at_data(name) is True  # its data seen only now: owners first
    assert second.route(name) == Turn(Route.LATER, 104.0, 2)
    # An explicit start (the store's: each record is announced once) is not remembered.
    second.forget(name)
    assert second.route(name, 200.0, since=200.0) == Turn(Route.LATER, 202.0, 2)
    assert second.route(name, 300.0) == Turn(Route.LATER, 302.0, 2)


def test_the_store_and_the_directory_route_through_one_schedule() -> None:
    members = MEMBERS[:8]
    clock = FakeClock(0.0)
    for name in NAMES[:50]:
        ranking = Ring(members).ranking(name, STAND_INS + 1)
        for me in members:
            directory = Ownership(lambda: members, me, 2.0, clock=clock)
            store = Ownership(lambda: members, me, 2.0, others_wait=False, clock=clock)
            a, b = directory.route(name, since=0.0), store.route(name, since=0.0)
            if me in ranking:
                assert a == b == Turn(a.route, 2.0 * ranking.index(me), ranking.index(me))
            else:
                assert (a.route, a.at, b.route) == (Route.LATER, 6.0, Route.LEAVE)
