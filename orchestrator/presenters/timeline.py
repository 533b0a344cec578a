"""The task page's timeline: one bar per started step, from started_at to finished_at, on
lanes so that steps which ran at the same time do not overlap.

Positions are percentages of the run's span, rendered as SVG attributes (x, width): the
Content-Security-Policy forbids inline style attributes, SVG geometry is not style.
"""
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from ..models import Step, StepStatus

MIN_BAR_PERCENT = 0.4  # an instant step still shows as a sliver
LANE_HEIGHT = 18  # px, the SVG's own units
LANE_GAP = 4


@dataclass(frozen=True)
class TimelineBar:
    step_id: str
    title: str
    status: str  # the step's status, or "running" (started, not finished) / "retrying"
    lane: int
    x: str  # percent of the span, formatted for an SVG attribute
    width: str
    y: int
    started_at: datetime
    finished_at: datetime | None
    seconds: float
    attempts: int

    @property
    def retried(self) -> bool:
        return self.attempts > 1

    @property
    def label(self) -> str:
        """The bar's tooltip."""
        title = f" — {self.title}" if self.title else ""
        retried = f", attempt {self.attempts}" if self.retried else ""
        return f"{self.step_id}{title}: {self.status}, {self.seconds} s from {clock_time(self.started_at)}{retried}"


@dataclass(frozen=True)
class TimelineMarker:
    """A recovery: another worker took the task over after its worker died."""
    x: str
    at: datetime
    label: str


@dataclass(frozen=True)
class Timeline:
    bars: list[TimelineBar]
    markers: list[TimelineMarker]
    lanes: int
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def height(self) -> int:
        return max(1, self.lanes) * (LANE_HEIGHT + LANE_GAP)

    @property
    def span_seconds(self) -> float:
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return (self.finished_at - self.started_at).total_seconds()


def clock_time(value: datetime) -> str:
    return timezone.localtime(value).strftime("%H:%M:%S")


def pack_lanes(intervals: list[tuple[datetime, datetime]]) -> list[int]:
    """The lane of each interval: greedy interval packing in start order, each interval on
    the first lane free by its start (a step starting when another ends shares its lane)."""
    lane_ends: list[datetime] = []
    lanes = [0] * len(intervals)
    for index in sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1])):
        start, end = intervals[index]
        for lane, lane_end in enumerate(lane_ends):
            if lane_end <= start:
                lane_ends[lane] = end
                lanes[index] = lane
                break
        else:
            lanes[index] = len(lane_ends)
            lane_ends.append(end)
    return lanes


def display_status(step: Step) -> str:
    if step.started_at and not step.finished_at:
        return StepStatus.RUNNING
    if step.status == StepStatus.PENDING and step.finished_at:
        return "retrying"  # its last attempt failed; it runs again
    return step.status


def _percent(value: float) -> str:
    return f"{max(0.0, min(100.0, value)):.3f}"


def step_timeline(steps: list[Step], *, recoveries: list[tuple[datetime, str]], now: datetime) -> Timeline:
    """The timeline of `steps` (those never started have no bar); a running step's bar
    ends at `now`. `recoveries`: (when, label) of each recovery, marked across the lanes
    (the span reaches the latest one)."""
    started = [s for s in steps if s.started_at]
    if not started:
        return Timeline(bars=[], markers=[], lanes=0, started_at=None, finished_at=None)
    intervals = [(s.started_at, s.finished_at or max(now, s.started_at)) for s in started]
    begin = min(start for start, _ in intervals)
    recoveries = [(when, label) for when, label in recoveries if when >= begin]  # before any step: nothing to mark
    end = max([finish for _, finish in intervals] + [when for when, _ in recoveries])
    span = max((end - begin).total_seconds(), 1e-6)
    lanes = pack_lanes(intervals)
    bars = []
    for step, (start, finish), lane in zip(started, intervals, lanes):
        offset = 100 * (start - begin).total_seconds() / span
        width = max(MIN_BAR_PERCENT, 100 * (finish - start).total_seconds() / span)
        bars.append(TimelineBar(
            step_id=step.step_id, title=step.title, status=display_status(step), lane=lane,
            x=_percent(min(offset, 100 - MIN_BAR_PERCENT)), width=_percent(width),
            y=lane * (LANE_HEIGHT + LANE_GAP), started_at=start, finished_at=step.finished_at,
            seconds=round((finish - start).total_seconds(), 2), attempts=step.attempts))
    markers = [TimelineMarker(x=_percent(100 * (at - begin).total_seconds() / span), at=at,
                              label=f"{label} at {clock_time(at)}") for at, label in recoveries]
    return Timeline(bars=bars, markers=markers, lanes=max(lanes) + 1, started_at=begin, finished_at=end)
