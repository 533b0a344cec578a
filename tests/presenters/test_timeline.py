"""The timeline presenter: lanes by greedy interval packing, running and retried steps,
recoveries — plain objects, no database."""
from datetime import datetime, timedelta, timezone

from orchestrator.models import Step
from orchestrator.presenters.timeline import pack_lanes, step_timeline

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def step(step_id: str, start: float | None, finish: float | None, status: str = "done", attempts: int = 1) -> Step:
    return Step(step_id=step_id, position=0, status=status, attempts=attempts,
                started_at=at(start) if start is not None else None,
                finished_at=at(finish) if finish is not None else None)


def lanes_of(timeline) -> dict[str, int]:
    return {bar.step_id: bar.lane for bar in timeline.bars}


def test_two_overlapping_steps_get_two_lanes():
    timeline = step_timeline([step("a", 0, 10), step("b", 5, 15)], recoveries=[], now=at(20))
    assert lanes_of(timeline) == {"a": 0, "b": 1} and timeline.lanes == 2


def test_sequential_steps_share_one_lane():
    timeline = step_timeline([step("a", 0, 10), step("b", 10, 12), step("c", 13, 20)], recoveries=[], now=at(30))
    assert lanes_of(timeline) == {"a": 0, "b": 0, "c": 0} and timeline.lanes == 1


def test_a_freed_lane_is_reused_before_a_new_one_is_opened():
    assert pack_lanes([(at(0), at(10)), (at(1), at(3)), (at(4), at(6)), (at(2), at(5))]) == [0, 1, 1, 2]


def test_bars_are_placed_in_percent_of_the_span():
    bars = step_timeline([step("a", 0, 25), step("b", 25, 100)], recoveries=[], now=at(200)).bars
    assert [(b.x, b.width) for b in bars] == [("0.000", "25.000"), ("25.000", "75.000")]


def test_a_retried_step_is_marked_and_a_failed_attempt_that_retries_says_so():
    timeline = step_timeline([step("a", 0, 10, attempts=3), step("b", 0, 4, status="pending", attempts=1)],
                             recoveries=[], now=at(20))
    a, b = timeline.bars
    assert a.retried and a.attempts == 3 and a.status == "done"
    assert not b.retried and b.status == "retrying"


def test_a_started_unfinished_step_is_running_until_now():
    timeline = step_timeline([step("a", 0, 10), step("b", 10, None, status="pending")], recoveries=[], now=at(40))
    a, b = timeline.bars
    assert b.status == "running" and b.finished_at is None and b.seconds == 30.0
    assert timeline.finished_at == at(40) and (a.width, b.x, b.width) == ("25.000", "25.000", "75.000")


def test_steps_never_started_have_no_bar():
    timeline = step_timeline([step("a", None, None, status="pending")], recoveries=[], now=at(5))
    assert timeline.bars == [] and timeline.lanes == 0


def test_recoveries_are_marked_within_the_run():
    timeline = step_timeline([step("a", 10, 20)], recoveries=[(at(5), "too early"), (at(40), "recovery 1")],
                             now=at(50))
    assert [(m.label, m.x) for m in timeline.markers] == [("recovery 1 at 12:00:40", "100.000")]
    assert timeline.finished_at == at(40)
