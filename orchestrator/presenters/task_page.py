"""What the task page and the task list show: the context their templates render, for the
first page (orchestrator/web/tasks.py) and for live updates (orchestrator/live.py) alike.

Secrets: this is the page's one redaction boundary (orchestrator/primitives/redaction.py).
Everything the page shows that a task, a tool or a model wrote — params, step and WAL errors,
WAL arguments, event payloads, the dialog and its tool calls, snapshot changes, the stack's
reasons, audit reasons — is redacted here, on the objects the templates read (never saved).
Every role sees the same redacted page: there is no view of the raw values outside the
database and the Django admin."""
import json
from collections import Counter
from datetime import datetime, timezone as dt_timezone
from decimal import Decimal

from django.db.models import Sum
from django.utils import timezone

from .. import roles
from ..agent import compaction, history
from ..engine import actions as task_actions, inbox, llm_ledger, snapshots, states
from ..engine import compat, verbs
from ..models import AgentMessage, Task
from ..primitives.redaction import redact, redact_text
from ..tasktypes import all_types
from .snapshots import snapshot_history
from .timeline import step_timeline
from .waiting import with_waiting_on
from .waits import with_review_waits

STEP_ROWS_SHOWN = 2000
WAL_ROWS_SHOWN = 500
EVENTS_SHOWN = 200
AUDIT_SHOWN = 500
INBOX_SHOWN = 50
SNAPSHOTS_SHOWN = 20  # the newest kept versions (a long run keeps up to ORCH_SNAPSHOT_FULL_EVERY more)
REVIEWS_SHOWN = 50  # the task's review items and approvals on its page, open ones first

# The page's clock (heartbeat age, a running step's bar): one call per render, so every
# region of one render agrees; tests replace it to compare renders made at different times.
page_clock = timezone.now


def json_text(value, indent=None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=indent is not None, default=str)


def with_payload_json(events):
    for event in events:
        event.payload_json = json_text(redact(event.payload))
    return events


def redact_fields(obj, *names: str):
    """`obj` with its attributes `names` redacted in place, for display only (never saved)."""
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, (str, dict, list, tuple)):
            setattr(obj, name, redact(value))
    return obj


def type_title(task_type: str) -> str:
    found = all_types().get(task_type)
    return found.title if found else ""


def task_page_context(task: Task, user, *, with_events: bool = True) -> dict:
    """Everything task_detail.html and its region partials (templates/orchestrator/task/)
    render; `user` decides the controls (engine/actions.py). Live refreshes skip the event
    rows (`with_events=False`): each event brings its own row."""
    now = page_clock()
    redact_fields(task, "title", "error", "status_reason", "activities", "stack", "waiting_for")
    with_waiting_on(with_review_waits(with_unreviewed_effects([task]), now), now)
    steps = [redact_fields(step, "title", "error")
             for step in with_running(task, list(task.steps.all()[:STEP_ROWS_SHOWN]))]
    wal = list(task.wal_entries.order_by("-id")[:WAL_ROWS_SHOWN])
    for entry in wal:
        redact_fields(entry, "error")
        entry.args_json = json_text(redact(entry.args))
    events = with_payload_json(list(task.events.order_by("-seq")[:EVENTS_SHOWN])) if with_events else []
    recoveries = [(e.created_at, f"recovery {e.payload.get('attempt', '')}".strip())
                  for e in task.events.filter(kind="recovery").order_by("seq")]
    verdicts = task_actions.available(task, user)
    heartbeat_age = (now - task.heartbeat_at).total_seconds() if task.heartbeat_at else None
    dialog = conversation(task)
    inbox_rows = list(task.inbox.order_by("-seq")[:INBOX_SHOWN])
    reviews = review_items(task)
    steps_total = task.steps.count()
    return {
        "task": task,
        "type_title": type_title(task.type),
        "params_json": json_text(redact(task.params), indent=2),
        "limits": sorted(redact(task.limits).items()) if isinstance(task.limits, dict) else [],
        "heartbeat_age": heartbeat_age,
        "steps": steps,
        "steps_total": steps_total,
        "timeline": step_timeline(steps, recoveries=recoveries, now=now),
        "wal": wal,
        "wal_total": task.wal_entries.count(),
        "snapshots": [{**row, "changes": redact(row["changes"]), "note": redact_text(row["note"])}
                      for row in snapshot_history(snapshots.history(task.pk, SNAPSHOTS_SHOWN))],
        "events": events,
        "events_shown": EVENTS_SHOWN,
        "audit": [redact_fields(entry, "reason")
                  for entry in task.audit_entries.select_related("actor").all()[:AUDIT_SHOWN]],
        "inbox": inbox_rows,
        "reviews": reviews,
        "stack_top_first": list(reversed(task.stack or [])),
        "conversation": dialog,
        "conversation_cost": conversation_cost(task),
        "sendable_types": sendable_types(task),
        # The same id until the inbox moves on: a double click sends one event (the inbox
        # dedupes it); once the event is in, the page re-renders with the next id.
        "send_event_id": f"page-{getattr(user, 'pk', 0)}-{task.pk}-{task.inbox_seq}",
        "can_operate": roles.OPERATOR in roles.user_roles(user) if user is not None else False,
        "actions": verdicts,
        "allowed_actions": " ".join(name for name, verdict in verdicts.items() if verdict.allowed),
        "controls": page_controls(task, verdicts),
        "controls_note": task_actions.controls_note(task, verdicts),
        "skippable_steps": task_actions.skippable_steps(task) if verdicts["skip_step"].allowed else [],
        # What changed in the type's code since the task paused (engine/compat.py), beside Resume.
        "compatibility": compat.for_page(task) if verdicts["resume"].allowed or verdicts["edit"].allowed else None,
        "is_terminal": task.status in states.TERMINAL,
        # A finished task holds no worker: no heartbeat or lease to read.
        "show_worker": task.status not in states.TERMINAL,
        "sections": page_sections(task, dialog=dialog, inbox_rows=inbox_rows, reviews=reviews,
                                  steps_total=steps_total),
    }


def page_controls(task: Task, verdicts: dict) -> list[dict]:
    """The task page's controls: one per operator verb that has one (engine/verbs.py), in the
    verbs' order, each with its template, verdict, tooltip and confirmation."""
    return [{"verb": verb, "verdict": verdicts[name], "template": verb.template, "hint": verb.hint_text(),
             "confirm": verb.confirm.format(id=task.pk)}
            for name, verb in verbs.VERBS.items() if verb.template and name in verdicts]


# The task page's tabs, in order: (key, label). The key is the tab's URL hash (/tasks/12/#effects)
# and names its panel (templates/orchestrator/task_detail.html); the regions each panel holds
# are in presenters/fragments.py.
SECTIONS = (
    ("overview", "Overview"),
    ("conversation", "Conversation"),
    ("steps", "Steps & timeline"),
    ("effects", "Effects & reviews"),
    ("inbox", "Inbox"),
    ("history", "History"),
)


def is_agent(task: Task) -> bool:
    """An agent task (a dialog with a model): its page has a Conversation tab."""
    from ..tasktypes.agent import PlanExecuteAgent

    return isinstance(all_types().get(task.type), PlanExecuteAgent) or task.agent_messages.exists()


def takes_events(task: Task) -> bool:
    """The task's type handles events of its own (a message, an awaited event, a subtask): its
    page offers the inbox even while it is empty. Every task takes the controls and the
    information types; those alone do not make an inbox worth a tab."""
    found = all_types().get(task.type)
    return found is not None and bool(getattr(found, "event_types", ()) or getattr(found, "awaited_event_types", ())
                                      or getattr(found, "subtasks", None))


def page_sections(task: Task, *, dialog, inbox_rows, reviews, steps_total: int) -> list[dict]:
    """The tabs the page shows: each with its key, label, count badge (None: no badge) and
    whether the badge asks for attention. Tabs that do not apply are left out: the
    conversation for a task that is not an agent, the inbox when the type takes no events
    and nothing was sent. Decided here, for the first page and every live update alike."""
    open_reviews = sum(1 for item in reviews if item.status == "open")
    counts = {
        "conversation": (len(dialog) if dialog is not None else 0, False),
        "steps": (steps_total, False),
        "effects": (open_reviews, open_reviews > 0) if open_reviews else (None, False),
        "inbox": (task.inbox_pending, True) if task.inbox_pending else (None, False),
    }
    shown = {
        "conversation": dialog is not None or is_agent(task),
        "inbox": bool(inbox_rows) or task.inbox_pending > 0 or takes_events(task),
    }
    titles = {"effects": "open reviews and approvals", "inbox": "pending events",
              "steps": "steps", "conversation": "messages"}
    return [{"key": key, "label": label, "count": counts.get(key, (None, False))[0],
             "alert": counts.get(key, (None, False))[1], "count_title": titles.get(key, "")}
            for key, label in SECTIONS if shown.get(key, True)]


def review_items(task: Task) -> list:
    """The task's review items and approvals, open ones first (each links to its page in the
    review queue)."""
    items = list(task.review_items.select_related("wal_entry").order_by("-detected_at", "-id")[:REVIEWS_SHOWN])
    for item in items:
        redact_fields(item, "reason")
    return sorted(items, key=lambda item: item.status != "open")


CONVERSATION_SHOWN = 200
MESSAGE_SHOWN_CHARACTERS = 4000


def conversation(task: Task) -> list[dict] | None:
    """An agent task's dialog as the page shows it (None for other types): each message, and
    each tool call with the status of its step and of its WAL entries."""
    if not task.agent_messages.exists():
        return None
    everything = history.current(task.pk)
    # Messages a compaction summarised are kept and shown, folded: the model reads the summary instead.
    summary = compaction.latest(everything)
    rows = everything[-CONVERSATION_SHOWN:]
    steps = dict(task.steps.filter(step_id__startswith="tool-").values_list("step_id", "status"))
    wal: dict[str, str] = {}
    for step_id, status in task.wal_entries.filter(step_id__startswith="tool-").values_list("step_id", "status"):
        wal[step_id] = status
    shown = []
    for row in rows:
        calls = [{**call, "step_status": steps.get(call.get("step", ""), ""), "wal_status": wal.get(call.get("step", ""), "")}
                 for call in redact(row.tool_calls)]
        content = redact_text(row.content)
        reasoning = redact_text(row.reasoning)
        if row.role == AgentMessage.Role.SUMMARY and row.interrupted:
            continue  # a summary being asked for, or lost with its process: nothing to read
        of = row.summary_of or {}
        shown.append({"role": row.role, "turn": row.turn, "name": row.name, "interrupted": row.interrupted,
                      "folded": row.role != AgentMessage.Role.SUMMARY and compaction.hidden_by(summary, row),
                      "summary_of": (f"turns {of.get('first_turn')}-{of.get('last_turn')}, {of.get('messages')} "
                                     f"message(s)" if of else ""),
                      "sent": row is summary,
                      "streaming": row.interrupted and not row.accounted and task.status == "running",
                      "content": content[:MESSAGE_SHOWN_CHARACTERS], "cut": len(content) > MESSAGE_SHOWN_CHARACTERS,
                      "reasoning": reasoning[:MESSAGE_SHOWN_CHARACTERS],
                      "reasoning_cut": len(reasoning) > MESSAGE_SHOWN_CHARACTERS,
                      "tool_calls": calls, "tokens": row.prompt_tokens + row.completion_tokens,
                      "estimated": row.tokens_estimated, "cost": format_cost(row.cost)})
    return shown


def conversation_cost(task: Task) -> str:
    """What the agent's model calls cost so far at their profiles' prices ("" when none has a
    price): every attempt in the ledger counted (engine/llm_ledger.py), retried, interrupted
    and lost ones and earlier generations included, as its tokens are."""
    return format_cost(task.model_attempts.aggregate(total=Sum("cost"))["total"])


def format_cost(value: Decimal | None) -> str:
    if value is None:
        return ""
    text = f"{value:.6f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def sendable_types(task: Task) -> list[str]:
    """The event types an operator can send this task from its page (not the controls,
    which have their buttons)."""
    found = all_types().get(task.type)
    if found is None or task.status in states.TERMINAL:
        return []
    return [name for name in inbox.accepted_types(found) if name not in inbox.control_types()]


def with_running(task: Task, steps: list) -> list:
    """Steps the runner reported running at its last heartbeat (task.activities) show as
    running, from when they started — a hint, not a commit per step."""
    if task.status not in states.ACTIVE or not task.activities:
        return steps
    since = {a.get("label"): a.get("since") for a in task.activities if a.get("kind") == "step"}
    for step in steps:
        started = since.get(step.step_id)
        if started is not None and step.status == "pending":
            step.status = "running"
            step.started_at = datetime.fromtimestamp(started, tz=dt_timezone.utc)
            step.finished_at = None
    return steps


def with_type_titles(tasks: list[Task]) -> list[Task]:
    """The list page's rows: each task with its type's title (shown when it has none), what its
    model calls cost (the ledger's, one grouped query for the page), its count of unreviewed
    effects, how long its open approvals and reviews have waited, and what it waits on."""
    types = all_types()
    costs = llm_ledger.costs_of([task.pk for task in tasks if task.tokens_used])
    for task in tasks:
        redact_fields(task, "title")
        task.type_title = types[task.type].title if task.type in types else ""
        task.model_cost = format_cost(costs.get(task.pk))
    now = page_clock()
    return with_waiting_on(with_review_waits(with_unreviewed_effects(tasks), now), now)


def with_unreviewed_effects(tasks: list[Task]) -> list[Task]:
    """Each task with `unreviewed_effects`: its side effects whose outcome is unknown and that
    no reviewer has decided yet (open review items of kind `effect`; approvals are not
    effects). One query for the whole list. Shown as a badge until decided, whatever the
    task's status: a stopped task's "maybe sent" email is as unknown as a running one's."""
    counts = Counter(Task.objects.filter(pk__in=[task.pk for task in tasks], review_items__status="open",
                                         review_items__kind="effect").values_list("pk", flat=True)) if tasks else {}
    for task in tasks:
        task.unreviewed_effects = counts.get(task.pk, 0)
    return tasks
