"""What a task is waiting on, said for people: "waiting for approval of email_send to
ops@example.org since 10:42 — open the approval". The task list, the task page (first paint
and live updates alike, through the same partial, templates/orchestrator/_waiting_on.html)
and the API (`waiting_on`) all show what `waiting_on` computes here; the templates only show it.

Every reason is read from durable rows, never from a process's memory: the task's status and
its columns (waiting_for, waiting_until, paused_by_limit, status_reason, the lease and its
heartbeat, `activities` — what the running step does, published with each heartbeat), its open
review items (an approval, a side effect in doubt), what a wait depends on (an upstream data
set named by the awaited event; a step's running subtasks), the in-flight model call's row (an agent's
stream: AgentMessage), the queue (unclaimed tasks by hand-over time), the operator's pause (the
audit), and the step durations of the task's type (a *stalled* task). A finished task waits on
nothing (None).

`with_waiting_on(tasks, now)` does it for a whole page in a fixed number of queries (one per
kind of fact some task of the page needs), whatever the number of tasks."""
import re
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.urls import reverse
from django.utils import timezone

from ..conf import harness
from ..engine import stalls, states
from ..models import AgentMessage, AuditEntry, ReviewItem, Task, TaskStatus as S
from ..primitives.redaction import redact_text
from .waits import duration_text

# Kinds, as the API names them.
KINDS = ("approval", "review", "event", "dependency", "timer", "tool", "llm", "step", "lease", "control", "recovery",
         "queue", "budget", "paused", "needs_human")
# What the running step does, most telling first (Task.activities' kinds: primitives/cancellation.track).
ACTIVITY_ORDER = {"tool": 0, "subprocess": 1, "smtp": 2, "mcp": 2, "http": 2, "llm": 3, "subtask": 4, "step": 5}
# Arguments of a proposed call that say what it acts on, in the order looked for.
TARGET_ARGUMENTS = ("to", "recipients", "recipient", "url", "path", "command", "query", "name")
# Awaited events that say another thing is ready, and the payload key that names which: a wait
# for one that names it (`match`) is a dependency (demo.pipeline's `wait_for_upstream`).
DEPENDENCY_EVENTS = {"upstream.ready": ("resource", "the upstream data set")}
LIMIT_WORDS = {"max_steps": "step limit", "max_tokens": "token limit", "max_seconds": "time limit",
               "max_subtasks": "subtask limit"}
# How far into the queue places are counted: a task further back is "behind more than 1,000".
QUEUE_COUNTED = 1000
# Stalled: engine/stalls.py decides (ORCH_STALL_FACTOR × the p95 of the type's step durations).


@dataclass(frozen=True)
class WaitingOn:
    kind: str  # one of KINDS
    text: str  # the sentence, without the link's words
    since: datetime | None = None
    link: str = ""  # where the item waited on is (an approval, a review), or ""
    link_text: str = ""  # the link's words ("open the approval")
    deadline: datetime | None = None  # when the wait ends by itself (an approval's deadline, a timer)
    stalled: bool = False  # running with no progress for k × the p95 of its type's step durations

    @property
    def sentence(self) -> str:
        return f"{self.text} — {self.link_text}" if self.link and self.link_text else self.text


def clock(value: datetime, now: datetime) -> str:
    """A moment as a person reads it on a page: "10:42" today, "2026-12-01 10:42" otherwise."""
    local, today = timezone.localtime(value), timezone.localtime(now)
    return f"{local:%H:%M}" if local.date() == today.date() else f"{local:%Y-%m-%d %H:%M}"


def ago(since: datetime | None, now: datetime) -> str:
    return duration_text((now - since).total_seconds()) if since else ""


def call_target(arguments) -> str:
    """What a proposed call acts on ("ops@example.org", "https://..."), or ""."""
    if not isinstance(arguments, dict):
        return ""
    for name in TARGET_ARGUMENTS:
        value = arguments.get(name)
        if isinstance(value, (list, tuple)):
            shown = [str(v) for v in value[:2]]
            value = ", ".join(shown) + (f" and {len(value) - 2} more" if len(value) > 2 else "") if shown else ""
        if isinstance(value, (str, int)) and str(value).strip():
            text = str(value).strip()
            return text if len(text) <= 80 else text[:79] + "…"
    return ""


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _unclaimed(task: Task) -> bool:
    """Waiting for a worker: queued, or running with no lease (between time slices, or recovered)."""
    return task.status == S.QUEUED or (task.status == S.RUNNING and not task.lease_owner)


_running = stalls.running


def queue_head_sql() -> str:
    """The queue's first QUEUE_COUNTED + 1 tasks waiting for a worker, in hand-over order."""
    return (f"SELECT id, enqueued_at FROM {Task._meta.db_table} "
            f"WHERE status IN ('{S.QUEUED}', '{S.RUNNING}') AND lease_owner = '' "
            f"ORDER BY enqueued_at ASC NULLS LAST, id ASC LIMIT {QUEUE_COUNTED + 1:d}")


class Facts:
    """What the reasons need beyond the task rows, read once for a batch of tasks."""

    def __init__(self, tasks: list[Task]):
        ids = lambda pred: [t.pk for t in tasks if pred(t)]  # noqa: E731
        waiting = ids(lambda t: t.status in (S.WAITING, S.AWAITING_REVIEW))
        self.items: dict[int, list] = {}
        if waiting:
            for item in (ReviewItem.objects.filter(task_id__in=waiting, status="open").select_related("wal_entry")
                         .order_by("detected_at", "id")):
                self.items.setdefault(item.task_id, []).append(item)
        running = ids(_running)
        self.attempts: dict[int, AgentMessage] = {}
        if running:
            for row in (AgentMessage.objects.filter(task_id__in=running, role=AgentMessage.Role.ASSISTANT,
                                                    interrupted=True, accounted=False)
                        .only("id", "task_id", "step_id", "completion_tokens", "created_at").order_by("id")):
                self.attempts[row.task_id] = row  # the newest per task
        # Each unclaimed task's place in the queue and the queue's length, counted by the database
        # over the queue's head only (its first QUEUE_COUNTED tasks, read in order from the partial
        # index task_unclaimed_queue): ranking the whole queue cost every POST /api/tasks a read of
        # every task waiting (11.6 ms of PostgreSQL with 5,000 queued, growing with the queue).
        self.queue_length = 0  # QUEUE_COUNTED + 1 means "more than QUEUE_COUNTED"
        self.positions: dict[int, int] = {}
        unclaimed = ids(_unclaimed)
        if unclaimed:
            # Written as SQL (every POST /api/tasks answers with it; the ORM's window query cost
            # more to build than the database's work). Its WHERE and ORDER BY are the index's, as
            # literals: a partial index serves only a query whose WHERE is known to imply its own.
            marks = ", ".join(["%s"] * len(unclaimed))
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT queued_task, position, length FROM ("
                               f"SELECT id AS queued_task, ROW_NUMBER() OVER (ORDER BY enqueued_at ASC NULLS LAST, "
                               f"id ASC) AS position, COUNT(id) OVER () AS length FROM ({queue_head_sql()}) head) "
                               f"ranked WHERE ranked.queued_task IN ({marks}) OR ranked.position = 1", unclaimed)
                for pk, position, length in cursor.fetchall():
                    self.queue_length = length
                    if pk in unclaimed and position <= QUEUE_COUNTED:
                        self.positions[pk] = position
        paused = ids(lambda t: t.status == S.PAUSED and not t.paused_by_limit)
        self.pauses: dict[int, AuditEntry] = {}
        if paused:
            for entry in (AuditEntry.objects.filter(task_id__in=paused, action="task.pause")
                          .only("task_id", "actor_name", "at").order_by("at", "id")):
                self.pauses[entry.task_id] = entry  # the latest per task
        self.stall_after = stalls.thresholds({t.type for t in tasks if _running(t)})


def waiting_on(task: Task, now: datetime | None = None, facts: Facts | None = None) -> WaitingOn | None:
    """What `task` waits on now, or None (a finished task, or nothing to say)."""
    now = now or timezone.now()
    if task.status in states.TERMINAL:
        return None
    facts = facts if facts is not None else Facts([task])
    found = _reason(task, now, facts)
    if found is None:
        return None
    return WaitingOn(kind=found.kind, text=redact_text(found.text), since=found.since, link=found.link,
                     link_text=found.link_text, deadline=found.deadline, stalled=found.stalled)


def with_waiting_on(tasks: list[Task], now: datetime | None = None) -> list[Task]:
    """Each task with `waiting_on` (a WaitingOn or None), in a fixed number of queries."""
    now = now or timezone.now()
    facts = Facts([t for t in tasks if t.status not in states.TERMINAL])
    for task in tasks:
        task.waiting_on = waiting_on(task, now, facts)
    return tasks


def _reason(task: Task, now: datetime, facts: Facts) -> WaitingOn | None:
    status = task.status
    if status == S.WAITING:
        return _approval(task, now, facts) or _waits(task, now)
    if status == S.AWAITING_REVIEW:
        return _review(task, now, facts)
    if status == S.NEEDS_HUMAN:
        why = task.status_reason or "automatic recovery gave up"
        return WaitingOn("needs_human", f"needs a person since {clock(task.updated_at, now)}: {why}",
                         since=task.updated_at)
    if status == S.PAUSED:
        return _paused(task, now, facts)
    if _unclaimed(task):
        return _queued(task, now, facts)
    if _running(task):
        return _running_reason(task, now, facts)
    return None


def _approval(task: Task, now: datetime, facts: Facts) -> WaitingOn | None:
    approvals = [i for i in facts.items.get(task.pk, []) if i.kind == "approval"]
    if not approvals:
        return None
    first = approvals[0]
    target = call_target(first.proposal.get("arguments") if isinstance(first.proposal, dict) else None)
    what = f"{first.tool or 'a tool call'}" + (f" to {target}" if target else "")
    more = f" (and {len(approvals) - 1} more)" if len(approvals) > 1 else ""
    deadline = first.expires_at
    due = ""
    if deadline is not None:
        due = (f", deadline {clock(deadline, now)}" if deadline > now
               else f", overdue since {clock(deadline, now)}")
    text = f"waiting for approval of {what}{more} since {clock(first.detected_at, now)} (approval #{first.pk}{due})"
    link = reverse("review:detail", args=[first.pk]) if len(approvals) == 1 else \
        reverse("review:queue") + f"?task={task.pk}"
    return WaitingOn("approval", text, since=first.detected_at, link=link,
                     link_text="open the approval" if len(approvals) == 1 else "open the approvals", deadline=deadline)


def _review(task: Task, now: datetime, facts: Facts) -> WaitingOn:
    items = [i for i in facts.items.get(task.pk, []) if i.kind == "effect"]
    if not items:
        return WaitingOn("review", f"waiting for a review since {clock(task.updated_at, now)}: {task.status_reason}"
                         .rstrip(": "), since=task.updated_at, link=reverse("review:queue") + f"?task={task.pk}",
                         link_text="open the review queue")
    first = items[0]
    target = call_target(first.wal_entry.args if first.wal_entry_id else None)
    what = f"{first.tool or 'a side effect'}" + (f" to {target}" if target else "")
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    text = (f"waiting for a reviewer to say whether {what} happened{more}, since {clock(first.detected_at, now)} "
            f"(review #{first.pk})")
    link = reverse("review:detail", args=[first.pk]) if len(items) == 1 else \
        reverse("review:queue") + f"?task={task.pk}"
    return WaitingOn("review", text, since=first.detected_at, link=link,
                     link_text="open the review" if len(items) == 1 else "open the reviews")


def _waits(task: Task, now: datetime) -> WaitingOn:
    waits = [w for w in task.waiting_for or [] if isinstance(w, dict)]
    since = task.updated_at
    deadline = task.waiting_until
    until = f", until {clock(deadline, now)} at the latest" if deadline else ""
    if not waits:
        if deadline is None:
            return WaitingOn("event", f"waiting since {clock(since, now)}: {task.status_reason or 'for an event'}",
                             since=since)
        return WaitingOn("timer", f"waiting for a timer: wakes at {clock(deadline, now)} "
                                  f"(in {ago(now, deadline) if deadline > now else 'a moment'})",
                         since=since, deadline=deadline)
    depends = [found for found in (_dependency(w) for w in waits) if found]
    if depends:
        steps = ", ".join(str(w.get("step")) for w in waits if w.get("step"))
        more = f" (and {len(depends) - 1} more)" if len(depends) > 1 else ""
        return WaitingOn("dependency", f"waiting for {depends[0]} to be ready{more} since {clock(since, now)}"
                         + (f" (step {steps})" if steps else "") + until, since=since, deadline=deadline)
    types = []
    for wait in waits:
        name = str(wait.get("type") or "an event")
        if name not in types:
            types.append(name)
    steps = ", ".join(str(w.get("step")) for w in waits if w.get("step"))
    what = "the event " + types[0] if len(types) == 1 else "the events " + ", ".join(types)
    return WaitingOn("event", f"waiting for {what} since {clock(since, now)}" + (f" (step {steps})" if steps else "")
                     + until, since=since, deadline=deadline)


def _dependency(wait: dict) -> str:
    """What a wait depends on, for people ("the upstream data set sales-2026 (upstream.ready)"), or
    "" when it is a plain event wait (it does not name what it waits for)."""
    known = DEPENDENCY_EVENTS.get(str(wait.get("type")))
    match = wait.get("match") if isinstance(wait.get("match"), dict) else {}
    if not known or match.get(known[0]) in (None, ""):
        return ""
    return f"{known[1]} {match[known[0]]} ({wait.get('type')})"


def _paused(task: Task, now: datetime, facts: Facts) -> WaitingOn:
    if task.paused_by_limit:
        limit = task.paused_by_limit
        value = (task.limits or {}).get(limit) if isinstance(task.limits, dict) else None
        used = {"max_steps": task.steps_done, "max_tokens": task.tokens_used,
                "max_seconds": round(task.active_seconds)}.get(limit)
        numbers = f" ({used} of {value})" if used is not None and value is not None else \
            (f" ({value})" if value is not None else "")
        text = (f"paused at its {LIMIT_WORDS.get(limit, limit)}{numbers} since {clock(task.updated_at, now)}: "
                f"raise {limit} to resume")
        return WaitingOn("budget", text, since=task.updated_at)
    entry = facts.pauses.get(task.pk)
    since = entry.at if entry else task.updated_at
    by = f" by {entry.actor_name}" if entry and entry.actor_name else ""
    why = task.status_reason
    reason = f": {why}" if why and why not in ("paused by an operator", "pause by an operator") else ""
    return WaitingOn("paused", f"paused{by} since {clock(since, now)}{reason} — waiting for Resume", since=since)


def _queued(task: Task, now: datetime, facts: Facts) -> WaitingOn:
    since = task.enqueued_at or task.created_at
    position = facts.positions.get(task.pk)
    more = facts.queue_length > QUEUE_COUNTED
    if position:
        where = f"{ordinal(position)} of {f'over {QUEUE_COUNTED:,}' if more else facts.queue_length} in the queue"
    elif more:
        where = f"behind more than {QUEUE_COUNTED:,} tasks in the queue"
    else:
        where = "in the queue"
    if task.status == S.RUNNING and task.recovering_since:
        return WaitingOn("recovery", f"being recovered since {clock(task.recovering_since, now)} (its worker "
                                     f"stopped): waiting for a worker to take it over, {where}",
                         since=task.recovering_since)
    if task.status == S.RUNNING:
        return WaitingOn("queue", f"between time slices: waiting {ago(since, now)} for a worker, {where}", since=since)
    return WaitingOn("queue", f"waiting {ago(since, now)} for a worker, {where}", since=since)


def _running_reason(task: Task, now: datetime, facts: Facts) -> WaitingOn:
    activities = [a for a in task.activities or [] if isinstance(a, dict)]
    kind, what, since = _activity(task, activities, now, facts)
    lease = f"worker {task.worker_host or task.lease_owner}" + (f" (pid {task.worker_pid})" if task.worker_pid else "")
    if task.heartbeat_at is None:
        beat = "no heartbeat yet"
    else:
        age = (now - task.heartbeat_at).total_seconds()
        beat = f"heartbeat {ago(task.heartbeat_at, now)} ago"
        if age > harness.stale_after_seconds:
            beat = f"no heartbeat for {ago(task.heartbeat_at, now)}: the sweeper will recover it"
    stalled, progress_since, stalled_after = stalls.is_stalled(task, now, facts.stall_after)
    text = f"{what} · {lease}, {beat}"
    if stalled:
        text += f" · stalled: no step finished for {ago(progress_since, now)} (over {duration_text(stalled_after)})"
    if task.status in (S.PAUSING, S.STOPPING) and task.control:
        asked = f" (asked {ago(task.control_requested_at, now)} ago)" if task.control_requested_at else ""
        return WaitingOn("control", f"{task.status}{asked}: waiting for the running work to end — {text}",
                         since=task.control_requested_at or since, stalled=stalled)
    return WaitingOn(kind, text, since=since, stalled=stalled)


# What a running step's activity reads as (a tool's, with its pid, and a step's are built below).
ACTIVITY_TEXT = {
    "subprocess": ("tool", "running a subprocess ({label})"),
    "smtp": ("tool", "sending an {label}"),
    "http": ("tool", "waiting on {label}"),
    "mcp": ("tool", "calling the MCP server ({label})"),
    "llm": ("llm", "streaming from the model"),
}


def _activity(task: Task, activities: list[dict], now: datetime, facts: Facts) -> tuple[str, str, datetime | None]:
    """(kind, "running email_send (pid 1234) for 12 s", since) of what the running step does."""
    ranked = sorted((a for a in activities if a.get("kind") in ACTIVITY_ORDER),
                    key=lambda a: (ACTIVITY_ORDER[a["kind"]], -(stalls.when(a.get("since")) or now).timestamp()))
    subprocess = next((a for a in activities if a.get("kind") == "subprocess"), None)
    pid_match = re.match(r"pid (\d+)", str(subprocess.get("label", ""))) if subprocess else None
    attempt = facts.attempts.get(task.pk)
    if ranked:
        top = ranked[0]
        kind, label, since = top["kind"], str(top.get("label", "")), stalls.when(top.get("since"))
        took = f" for {ago(since, now)}" if since else ""
        if kind == "tool":
            pid = pid_match.group(1) if pid_match else task.worker_pid
            return "tool", f"running {label}" + (f" (pid {pid})" if pid else "") + took, since
        if kind == "subtask":  # the step waits for its subtasks' results (context.spawn)
            subtasks = [a for a in activities if a.get("kind") == "subtask"]
            step = next((a for a in activities if a.get("kind") == "step"), None)
            whose = f"step {step.get('label')}" if step and step.get("label") else "the step"
            more = f" (and {len(subtasks) - 1} more)" if len(subtasks) > 1 else ""
            return "dependency", f"{whose} waits for its subtask {label}{more}{took}", since
        if kind in ACTIVITY_TEXT:
            shown_as, text = ACTIVITY_TEXT[kind]
            return shown_as, text.format(label=label) + took, since
        if attempt is not None and attempt.step_id == label:
            return _stream(attempt, now)
        return "step", f"running step {label}{took}", since
    since = task.claimed_at or task.started_at
    return "lease", "running" + (f" for {ago(since, now)}" if since else ""), since


def _stream(attempt: AgentMessage, now: datetime) -> tuple[str, str, datetime]:
    seconds = max((now - attempt.created_at).total_seconds(), 0.0)
    rate = f", {attempt.completion_tokens / seconds:.0f} tokens/s" if attempt.completion_tokens and seconds >= 1 else ""
    tokens = f" ({attempt.completion_tokens} tokens{rate})" if attempt.completion_tokens else ""
    return "llm", f"streaming from the model for {duration_text(seconds)}{tokens}", attempt.created_at

