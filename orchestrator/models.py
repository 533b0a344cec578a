"""The durable state of the harness. Nothing relies on process memory for truth.

Only the engine's services write these rows (orchestrator/engine/); views, the API,
the admin and management commands call those services.
"""
from django.conf import settings
from django.db import models


class TaskStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    TERMINATED = "terminated"
    COMPLETED = "completed"
    FAILED = "failed"
    AWAITING_REVIEW = "awaiting_review"
    NEEDS_HUMAN = "needs_human"
    # A step waits for an event (ctx.wait_for): no worker is held; a matching event or
    # the wait's timer (the sweeper) queues the task again.
    WAITING = "waiting"


class Task(models.Model):
    type = models.CharField(max_length=100, db_index=True)
    title = models.CharField(max_length=200, blank=True)
    params = models.JSONField(default=dict)
    limits = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=TaskStatus.choices, default=TaskStatus.QUEUED)
    status_reason = models.CharField(max_length=500, blank=True)
    # The limit (max_steps, max_tokens, max_seconds, max_subtasks) that paused the task;
    # blank unless the runner paused it for a limit (every other transition clears it).
    paused_by_limit = models.CharField(max_length=20, blank=True, default="")
    error = models.TextField(blank=True)

    # Progress counters (denormalised so the list page needs no joins).
    steps_total = models.PositiveIntegerField(default=0)
    steps_done = models.PositiveIntegerField(default=0)
    tokens_used = models.PositiveBigIntegerField(default=0)
    active_seconds = models.FloatField(default=0.0)
    recovery_attempts = models.PositiveIntegerField(default=0)

    # Durability bookkeeping.
    checkpoint_version = models.PositiveIntegerField(default=0)
    event_seq = models.PositiveBigIntegerField(default=0)

    # The lease: who runs this task now. Every commit of a step is fenced on lease_epoch.
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_epoch = models.PositiveBigIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # When the current holder claimed it: a run that yields its slot to a recovered task is
    # chosen among those that have held theirs a while (lease.should_yield_to_recovered).
    claimed_at = models.DateTimeField(null=True, blank=True)
    worker_host = models.CharField(max_length=200, blank=True)
    worker_pid = models.PositiveIntegerField(null=True, blank=True)

    # Operator requests the runner polls while it runs (pause/stop/terminate).
    control = models.CharField(max_length=20, blank=True)
    control_requested_at = models.DateTimeField(null=True, blank=True)
    control_acknowledged_at = models.DateTimeField(null=True, blank=True)
    # While a Stop/Pause/Terminate winds down: what is still running (steps, subtasks,
    # subprocesses, requests, streams) and since when. Empty when nothing is.
    activities = models.JSONField(default=list, blank=True)
    # The inbox (InboundEvent): the last inbound seq given out, and how many events wait
    # to be consumed (the runner's supervisor polls it with the control column).
    inbox_seq = models.PositiveBigIntegerField(default=0)
    inbox_pending = models.PositiveIntegerField(default=0)
    # Durable waits: [{"step", "type", "until"}] of the steps waiting for an event, and the
    # earliest deadline (the sweeper wakes the task then; it survives restarts).
    waiting_for = models.JSONField(default=list, blank=True)
    waiting_until = models.DateTimeField(null=True, blank=True)
    # The task stack (engine/preemption.py): a frame per urgent subtask that suspended the
    # work below it, newest last; the runner runs only the top frame's steps. Depth <= 4.
    stack = models.JSONField(default=list, blank=True)
    # The compatibility fingerprint of the code the task last ran against (tasktypes/fingerprint.py):
    # written when a run starts and when a resume admits a change (engine/compat.py, the one writer);
    # a resume compares it with the code's now. Empty: never ran (nothing to compare).
    compat = models.JSONField(default=dict, blank=True)
    # Retention (engine/retention.py): when each rule was applied to this finished task.
    stream_events_dropped_at = models.DateTimeField(null=True, blank=True)
    events_compacted_at = models.DateTimeField(null=True, blank=True)
    wal_pruned_at = models.DateTimeField(null=True, blank=True)

    # When the task was last handed to the broker; the sweeper re-enqueues a queued task
    # nobody claimed for ORCH_REQUEUE_AFTER_SECONDS (a lost broker message strands nothing).
    enqueued_at = models.DateTimeField(null=True, blank=True)
    # Set when a recovery starts, cleared once a runner has the task going again: a
    # recovery older than ORCH_RECOVERY_TIMEOUT_SECONDS hands the task to a human.
    recovering_since = models.DateTimeField(null=True, blank=True)
    # A stall its operators were told of (engine/stalls.py): when the stalled step's progress
    # began; null when not stalled. The sweeper's compare-and-set on it tells each stall once.
    stalled_since = models.DateTimeField(null=True, blank=True)

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="tasks")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["status", "-id"], name="task_status_id"),
            # The retention rules' query: finished tasks by age.
            models.Index(fields=["finished_at"], name="task_finished_at"),
            models.Index(fields=["type", "-id"], name="task_type_id"),
            # The sweeper's query: running tasks by heartbeat age.
            models.Index(fields=["status", "heartbeat_at"], name="task_status_heartbeat"),
            # The sweeper's other queries: unclaimed queued tasks, and recoveries in progress.
            models.Index(fields=["status", "enqueued_at"], name="task_status_enqueued"),
            # The queue's head in order (presenters/waiting.py: a task's place in the queue), read
            # without ranking every task waiting.
            models.Index(fields=["enqueued_at", "id"], name="task_unclaimed_queue",
                         condition=models.Q(status__in=["queued", "running"], lease_owner="")),
            models.Index(fields=["recovering_since"], name="task_recovering_since",
                         condition=models.Q(recovering_since__isnull=False)),
            models.Index(fields=["status", "waiting_until"], name="task_status_waiting_until"),
        ]

    def __str__(self):
        return f"#{self.pk} {self.type} ({self.status})"

    @property
    def progress_percent(self) -> int:
        if not self.steps_total:
            return 100 if self.status == TaskStatus.COMPLETED else 0
        return int(100 * self.steps_done / self.steps_total)


class StepStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    # Given up on (the type's on_step_failure = "skip", or an operator's Skip step): the
    # task goes on without it; its dependants are skipped too.
    SKIPPED = "skipped"


class Step(models.Model):
    # db_index=False here and on the other per-task tables: each has a composite index that
    # starts with task_id (see Meta), which serves lookups by task; a one-column index beside
    # it would only cost a write per row (a step commit writes four such rows).
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="steps", db_index=False)
    step_id = models.CharField(max_length=200)
    position = models.PositiveIntegerField()
    title = models.CharField(max_length=300, blank=True)
    depends_on = models.JSONField(default=list)
    declared_reads = models.JSONField(default=list)
    # The param keys the step actually read while it ran (recorded, not declared).
    reads = models.JSONField(default=list)
    status = models.CharField(max_length=20, choices=StepStatus.choices, default=StepStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # Bumped each time a parameter edit or a rollback resets the step: its side effects
    # then get new idempotency keys (the old ones recorded the old params' effects).
    generation = models.PositiveIntegerField(default=0)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    # Exception type + normalised message of the last failure: the same failure twice
    # means retrying will not help (the task then needs a human).
    failure_fingerprint = models.CharField(max_length=64, blank=True)
    # The step's own failure policy once its retries are used up ("needs_human", "skip",
    # "fail"; blank: the task type's `on_step_failure`), and whether it still runs when a
    # dependency was skipped (a summary step does, and is told which were).
    on_failure = models.CharField(max_length=20, blank=True)
    runs_after_skipped = models.BooleanField(default=False)
    # The step that added this one to the plan while it ran ("" = the type's plan).
    added_by = models.CharField(max_length=200, blank=True)
    # Pending steps this added step was put in front of (StepSpec.before): they depend on it.
    before = models.JSONField(default=list, blank=True)
    # A result larger than ORCH_RESULT_INLINE_BYTES lives in a StepResult row, loaded only
    # when a dependant or a page asks for it; `result` is then null.
    result_stored_apart = models.BooleanField(default=False)
    result_bytes = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["task", "position"]
        constraints = [models.UniqueConstraint(fields=["task", "step_id"], name="step_unique_per_task")]
        # No index holds `status` (a task's steps by status are found through the unique index's
        # task prefix): a step's commit changes its status, and on PostgreSQL an update that
        # changes no indexed column can be HOT — no new index entries, less WAL per step
        # (migration 0037 also leaves room on each page for the step rows' updates).

    def __str__(self):
        return f"{self.task_id}/{self.step_id} ({self.status})"

    @property
    def duration_seconds(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class WalStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # a reviewer decided the task goes on without this effect


class WalEntry(models.Model):
    """A side effect's write-ahead-log record: intent before, outcome after."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="wal_entries", db_index=False)
    step_id = models.CharField(max_length=200)
    call_index = models.PositiveIntegerField()
    tool = models.CharField(max_length=100)
    args = models.JSONField(default=dict)
    idempotency_key = models.CharField(max_length=200, unique=True)
    idempotent = models.BooleanField()
    status = models.CharField(max_length=20, choices=WalStatus.choices, default=WalStatus.PENDING)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    lease_epoch = models.PositiveBigIntegerField()
    worker = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    # "probe": an outcome in doubt that the tool's probe settled (done or not done) by asking
    # the other side, so no reviewer saw it; "" otherwise. Counted on the review queue's page.
    settled_by = models.CharField(max_length=20, blank=True, default="")

    class Meta:
        ordering = ["task", "id"]
        verbose_name = "WAL entry"
        verbose_name_plural = "WAL entries"
        indexes = [
            models.Index(fields=["task", "status"], name="wal_task_status"),
            models.Index(fields=["status", "created_at"], name="wal_status_created"),
        ]

    def __str__(self):
        return f"{self.tool} {self.idempotency_key} ({self.status})"


class StepResult(models.Model):
    """A step result too large to keep inline in its Step row (see Step.result_stored_apart)."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="large_results", db_index=False)
    step_id = models.CharField(max_length=200)
    data = models.JSONField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "step_id"], name="step_result_unique_per_task")]

    def __str__(self):
        return f"{self.task_id}/{self.step_id} result"


class Snapshot(models.Model):
    """A checkpoint version: plan with step states, params, counters. Step results live
    in Step rows (referenced, loaded lazily), so a snapshot row stays small.

    A `full` row holds the whole state; a delta row (full=False) only what its version
    changed (engine/snapshots.py reads a version as the newest full row at or below it
    plus the deltas after it), so a commit's cost does not grow with the plan."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="snapshots", db_index=False)
    version = models.PositiveIntegerField()
    step_id = models.CharField(max_length=200, blank=True)
    full = models.BooleanField(default=True)
    state = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["task", "-version"]
        constraints = [models.UniqueConstraint(fields=["task", "version"], name="snapshot_unique_version")]

    def __str__(self):
        return f"task {self.task_id} v{self.version}"


class TaskEvent(models.Model):
    """The append-only progress log; `seq` rises by one per task with no gaps."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events", db_index=False)
    seq = models.PositiveBigIntegerField()
    kind = models.CharField(max_length=50)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["task", "seq"]
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="event_unique_seq")]
        # The metrics endpoint's count of recent recoveries (orchestrator/metrics.py): a partial
        # index, so the progress log's ordinary inserts never write to it.
        indexes = [models.Index(fields=["created_at"], name="event_recovery_created",
                                condition=models.Q(kind="recovery"))]

    def __str__(self):
        return f"task {self.task_id} #{self.seq} {self.kind}"


class InboundState(models.TextChoices):
    PENDING = "pending"      # waiting for the task to consume it at a resume point
    MERGED = "merged"        # superseded by a newer event of its merge group (superseded_by)
    CONSUMED = "consumed"    # the task applied it (outcome says how), exactly once
    REJECTED = "rejected"    # the task could not apply it (outcome says why)
    SHED = "shed"            # refused by backpressure (429); kept to be counted and listed
    EXPIRED = "expired"      # not consumed within its time to live


class InboundEvent(models.Model):
    """An event sent into a task (its inbox) — distinct from TaskEvent, the progress log,
    which is what the task tells the world. Senders only enqueue; the runner consumes at
    resume points, in the same transaction as the checkpoint it affects."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="inbox", db_index=False)
    seq = models.PositiveBigIntegerField()  # per task, from Task.inbox_seq
    type = models.CharField(max_length=100)
    priority = models.PositiveSmallIntegerField()  # 0 (interrupt) .. 4 (information)
    source = models.CharField(max_length=120)  # operator, user, system, internal, webhook:<name>
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_name = models.CharField(max_length=150, blank=True)
    source_event_id = models.CharField(max_length=200, blank=True)
    payload = models.JSONField(default=dict)
    payload_sha256 = models.CharField(max_length=64)
    merge_key = models.CharField(max_length=200, blank=True)
    state = models.CharField(max_length=20, choices=InboundState.choices, default=InboundState.PENDING)
    outcome = models.TextField(blank=True)
    superseded_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    occurred_at = models.DateTimeField(null=True, blank=True)
    visible_at = models.DateTimeField()  # a mergeable event waits out its burst
    consumed_at = models.DateTimeField(null=True, blank=True)
    consumed_in_version = models.PositiveIntegerField(null=True, blank=True)  # the checkpoint that applied it
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["task", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["task", "seq"], name="inbound_unique_seq"),
            # Dedupe: one event per (task, source, source_event_id), kept for the task's life.
            models.UniqueConstraint(fields=["task", "source", "source_event_id"], name="inbound_dedupe",
                                    condition=~models.Q(source_event_id="") & ~models.Q(state="shed")),
        ]
        indexes = [models.Index(fields=["task", "state", "priority", "seq"], name="inbound_pending")]

    def __str__(self):
        return f"task {self.task_id} inbox #{self.seq} {self.type} P{self.priority} ({self.state})"


class WebhookSource(models.Model):
    """An outside system that may post signed events into tasks (POST /api/hooks/<name>/...).

    Its secrets (Standard Webhooks `whsec_...`, 32 random bytes each) are shown once, when
    made; several are kept so a sender can rotate without a gap."""

    name = models.SlugField(max_length=60, unique=True)
    secrets = models.JSONField(default=list)  # never shown after creation (engine/webhooks.py)
    allowed_types = models.JSONField(default=list, help_text="event types it may send, e.g. [\"upstream.ready\"]")
    task_types = models.JSONField(default=list, help_text="task types it may post to, e.g. [\"demo.pipeline\"]")
    priority_ceiling = models.PositiveSmallIntegerField(default=1, help_text="the most urgent priority it may ask for")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return self.name


class WebhookRejection(models.Model):
    """Rejected webhook requests, counted (engine/webhooks.py): one row per source, reason and
    client address within REJECTION_WINDOW, its `count` raised by each repeat, so a flood of
    forged requests updates a row instead of writing one (and an audit entry) each. What the
    sender chose (the name asked for, its headers) is kept as a short prefix only."""

    source = models.CharField(max_length=60, blank=True, help_text="the source's name; empty for an unknown one")
    asked_for = models.CharField(max_length=60, blank=True, help_text="the name in the URL (the first one seen)")
    reason = models.CharField(max_length=100)
    ip = models.GenericIPAddressField(null=True, blank=True)
    count = models.PositiveIntegerField(default=1)
    first_at = models.DateTimeField(auto_now_add=True)
    last_at = models.DateTimeField(db_index=True)
    last_task_id = models.BigIntegerField(null=True, blank=True, help_text="the task id in the URL (not checked)")
    last_webhook_id = models.CharField(max_length=200, blank=True)
    last_user_agent = models.CharField(max_length=200, blank=True)

    class Meta:
        indexes = [models.Index(fields=["source", "reason", "ip", "last_at"], name="webhook_rejection_key")]

    def __str__(self):
        return f"{self.source or self.asked_for}: {self.reason} from {self.ip} ×{self.count}"


class IdempotencyRecord(models.Model):
    """Results of side effects by idempotency key: consulted before performing one."""

    key = models.CharField(max_length=200, unique=True)
    tool = models.CharField(max_length=100)
    result = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return self.key


class AuditEntry(models.Model):
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="audit_entries")
    actor_name = models.CharField(max_length=150, blank=True)
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    ip = models.GenericIPAddressField(null=True, blank=True)
    action = models.CharField(max_length=50, db_index=True)
    task = models.ForeignKey(Task, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_entries")
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    reason = models.TextField(blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self):
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name or 'system'} {self.action}"


class ApiToken(models.Model):
    """A bearer token for the API; only its SHA-256 is stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=12)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # None: the token never expires (until it is deleted in the admin).
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self):
        return f"{self.user} {self.prefix}…"

    def is_expired(self, now=None) -> bool:
        from django.utils import timezone

        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


class AgentMessage(models.Model):
    """One message of an agent task's dialog (agent.plan_execute), stored as it happens: the
    history sent to the model is rebuilt from these rows (orchestrator/agent/history.py).

    `key` is stable per message (the turn or tool step that wrote it, with its generation),
    so a step that runs again after a crash rewrites its own row instead of adding one."""

    class Role(models.TextChoices):
        SYSTEM = "system"
        USER = "user"
        ASSISTANT = "assistant"
        TOOL = "tool"
        # A compaction's summary of earlier turns (orchestrator/agent/compaction.py): sent in their
        # place; the rows it summarises are kept (audit, export, rollback) but no longer sent.
        SUMMARY = "summary"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="agent_messages", db_index=False)
    key = models.CharField(max_length=200)
    turn = models.PositiveIntegerField()  # the turn it belongs to (user messages: the turn they precede)
    order = models.PositiveIntegerField(default=0)  # within its turn: assistant 0, tool results 1.., user notes after
    role = models.CharField(max_length=20, choices=Role.choices)
    content = models.TextField(blank=True)
    # assistant: the model's reasoning (reasoning_content / reasoning deltas), kept apart from
    # `content`; sent back to the server only when its profile says so (send_reasoning_back).
    reasoning = models.TextField(blank=True)
    tool_calls = models.JSONField(default=list, blank=True)  # assistant: [{id, name, arguments}]
    tool_call_id = models.CharField(max_length=200, blank=True)  # tool: the call it answers
    name = models.CharField(max_length=200, blank=True)  # tool: the tool's name
    # An assistant message cut short by a pause, stop or preemption: kept, and said so to the model.
    interrupted = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    tokens_estimated = models.BooleanField(default=False)  # no usage chunk came: characters / 4
    # What this call's tokens cost at its model profile's prices (null: the profile has none).
    cost = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    # An interrupted attempt's tokens are added to the task's count by the attempt that completes the turn.
    accounted = models.BooleanField(default=True)
    step_id = models.CharField(max_length=200, blank=True)
    generation = models.PositiveIntegerField(default=0)  # of the step that wrote it (edits and rollbacks bump it)
    # summary: what it stands for: {"first_turn", "last_turn", "last_message_id", "digest", "messages"}
    # (the rows of turns first..last with ids up to last_message_id; digest: sha256 of their text).
    summary_of = models.JSONField(null=True, blank=True)
    # An attempt asked in background mode: the server's response id, recorded before the first
    # token, so that the step run after a crash retrieves the response instead of asking again.
    response_id = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["task", "turn", "order", "id"]
        constraints = [models.UniqueConstraint(fields=["task", "key"], name="agent_message_unique_key")]

    def __str__(self):
        return f"{self.task_id} turn {self.turn} {self.role}"


class ModelCallAttempt(models.Model):
    """One attempt at a model call, as the server billed it or as it is estimated: the ledger of
    every token and cent an agent spent (orchestrator/engine/llm_ledger.py, its one writer).
    Every attempt has a row: completed, cut at its token cap, cut by the server, cancelled by a
    Stop or Pause, retried after a 429/5xx, refused, failed, or lost with its process (found
    when the step runs again; estimated)."""

    class Outcome(models.TextChoices):
        COMPLETED = "completed"
        LENGTH = "length", "cut at its token cap"
        CUT = "cut", "stream cut by the server"
        CANCELLED = "cancelled", "cancelled (Stop, Pause, preemption)"
        RETRIED = "retried", "failed and retried"
        REFUSED = "refused", "refused by the server"
        FAILED = "failed", "failed (attempts used up)"
        LOST = "lost", "lost with its process"
        REATTACHED = "reattached", "completed, retrieved after its process died"

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="model_attempts", db_index=False)
    step_id = models.CharField(max_length=200)
    generation = models.PositiveIntegerField(default=0)
    purpose = models.CharField(max_length=20, default="turn")  # turn | summary
    profile = models.CharField(max_length=200, blank=True)
    model = models.CharField(max_length=200, blank=True)
    outcome = models.CharField(max_length=20, choices=Outcome.choices)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    estimated = models.BooleanField(default=False)  # no usage from the server: characters / 4
    cost = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)  # null: no prices
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["task", "id"], name="model_attempt_task")]

    def __str__(self):
        return f"{self.task_id} {self.step_id} {self.outcome}"


class AgentMemory(models.Model):
    """Long-term memory of agents: facts kept across tasks, read by the memory_search tool at
    prompt-building time and written by memory_write (through the WAL). Never copied into a
    snapshot."""

    key = models.CharField(max_length=200, primary_key=True)  # the scope's prefix, then the model's key
    value = models.TextField()
    task = models.ForeignKey(Task, null=True, on_delete=models.SET_NULL, related_name="+")
    # The step that wrote it: a rollback of its task removes the facts written after the version.
    step_id = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "agent_memory"


class RetentionRun(models.Model):
    """One run of the retention rules (engine/retention.py): what was pruned, when."""

    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    tasks = models.PositiveIntegerField(default=0)
    stream_events_deleted = models.PositiveBigIntegerField(default=0)
    events_deleted = models.PositiveBigIntegerField(default=0)
    wal_deleted = models.PositiveBigIntegerField(default=0)
    idempotency_deleted = models.PositiveBigIntegerField(default=0)
    notifications_deleted = models.PositiveBigIntegerField(default=0)  # webhook deliveries that were over
    webhook_rejections_deleted = models.PositiveBigIntegerField(default=0)  # rows of rejected incoming webhooks
    rules = models.JSONField(default=dict)  # the windows in force
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self):
        return f"retention run {self.started_at:%Y-%m-%d %H:%M}"


class EffectClass(models.TextChoices):
    """What calling a tool does to the world (../shared/AGENT.md, "Effect classes")."""
    READ_ONLY = "read_only", "read only (no WAL entry)"
    IDEMPOTENT = "idempotent", "idempotent (a replay is safe)"
    KEYED = "keyed", "keyed (the idempotency key travels to the other side)"
    NON_IDEMPOTENT = "non_idempotent", "not idempotent (unknown outcome → review; approval by default)"


class McpServer(models.Model):
    """An MCP server whose tools agents may be granted, as `<name>__<tool>` (tools/mcp.py).
    Declared here (the admin) or in ORCH_MCP_SERVERS (same shape; that one wins on a name clash).
    Exactly one of `command` (a stdio server: argv of a child process) or `url` (streamable HTTP)."""

    name = models.CharField(max_length=40, unique=True,
                            help_text="letters, digits, - and _ (no '__'): tools reach the model as <name>__<tool>")
    command = models.JSONField(default=list, blank=True, help_text='stdio: the argv, e.g. ["mcp-server-time"]')
    env = models.JSONField(default=dict, blank=True, help_text="stdio: extra environment of the child (secrets)")
    url = models.URLField(max_length=500, blank=True, help_text="streamable HTTP: the endpoint")
    # Secrets (a bearer token): never sent to a model, written to a log or exported.
    headers = models.JSONField(default=dict, blank=True, help_text="HTTP headers sent with every request (secrets)")
    tool_effects = models.JSONField(default=dict, blank=True,
                                    help_text="tool -> effect class, overriding what its annotations say")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name = "MCP server"

    def __str__(self):
        return self.name


def validate_http_url(value: str) -> None:
    """An http(s) URL with a host, whatever the host's name looks like."""
    from urllib.parse import urlsplit

    from django.core.exceptions import ValidationError

    parts = urlsplit(value or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError("Enter an http(s) URL such as http://gpu-1:8000/v1.")


class ModelProfile(models.Model):
    """A model server an agent task may pick with `model` (LLM_MODELS declares more; the
    installation's default stays LLM_BASE_URL / LLM_API_KEY / LLM_MODEL)."""

    name = models.CharField(max_length=60, unique=True)
    # Not a URLField: its validator refuses the hosts model servers usually have (gpu-1,
    # ollama: no dot, no TLD).
    base_url = models.CharField(max_length=500, validators=[validate_http_url],
                                help_text="OpenAI-compatible, e.g. http://gpu-1:8000/v1")
    api_key = models.CharField(max_length=500, blank=True, help_text="a secret: never shown, logged or exported")
    model = models.CharField(max_length=200, help_text="the model name the server expects")
    context_window = models.PositiveIntegerField(null=True, blank=True,
                                                 help_text="tokens (empty: LLM_CONTEXT_WINDOW)")
    price_input_per_million = models.DecimalField(max_digits=12, decimal_places=4, null=True, blank=True)
    price_output_per_million = models.DecimalField(max_digits=12, decimal_places=4, null=True, blank=True)
    price_cached_per_million = models.DecimalField(max_digits=12, decimal_places=4, null=True, blank=True)
    supports_tools = models.BooleanField(default=True, help_text="the server takes `tools` in a request")
    supports_stream_options = models.BooleanField(default=True,
                                                  help_text="the server takes stream_options.include_usage")
    send_reasoning_back = models.BooleanField(default=False,
                                              help_text="send reasoning_content back in later requests")
    background_responses = models.BooleanField(
        default=False, help_text="the server keeps background responses (the Responses API's background mode, as "
                                 "OpenAI's): a turn cut by a crash is retrieved, not paid for again")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class NotificationSubscription(models.Model):
    """An outgoing webhook: each event it takes is delivered, signed with the Standard Webhooks
    scheme (webhook-id, webhook-timestamp, webhook-signature), retried with backoff."""

    name = models.CharField(max_length=100)
    url = models.URLField(max_length=500)
    secret = models.CharField(max_length=200, help_text="whsec_<base64>: the receiver verifies with it")
    events = models.JSONField(default=list, blank=True,
                              help_text="event names to deliver (approval.requested, review.opened, "
                                        "approval.expired, task.needs_human, task.stalled); empty: all")
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} → {self.url}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"  # gave up after the last attempt


class NotificationDelivery(models.Model):
    """One event to one subscription; `message_id` is the webhook-id, the same on every retry
    so that a receiver can drop duplicates."""

    subscription = models.ForeignKey(NotificationSubscription, on_delete=models.CASCADE, related_name="deliveries")
    message_id = models.CharField(max_length=64, unique=True)
    event = models.CharField(max_length=60)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=20, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True, db_index=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "notification deliveries"


# --- what needs a person ---------------------------------------------------------------------
# An effect whose outcome is unknown (kind `effect`, with its WAL entry) or a tool call an
# agent wants to make that needs approval first (kind `approval`, with the proposed call; no
# WAL entry exists yet). The engine opens, expires and revokes these records itself; the
# review queue (review/) lists them and decides them through the engine's services. The
# engine never imports the review queue (pyproject.toml, [tool.importlinter]).

class ReviewStatus(models.TextChoices):
    OPEN = "open"
    DECIDED = "decided"
    # An approval nobody decided in time, whose fallback was `reject`: not a rejection (nobody
    # said no), and the model is told so. Closed: a decision afterwards is refused.
    EXPIRED = "expired"
    # An approval whose call can no longer run: its task was stopped, terminated or ended, or
    # rolled back (or edited) past its step. Closed, with the reason in `note`.
    REVOKED = "revoked"


class OnExpiry(models.TextChoices):
    """What an approval nobody decided in time does (per tool, AgentParams.approval_rules)."""
    REJECT = "reject", "expire: the call does not run and the model reads that the approval expired"
    KEEP_WAITING = "keep_waiting", "keep waiting for a reviewer (marked overdue)"
    ESCALATE = "escalate", "escalate to another group's reviewers, for one more timeout; then expire"


class ReviewKind(models.TextChoices):
    EFFECT = "effect", "side effect in doubt"
    APPROVAL = "approval", "tool call to approve"


class Decision(models.TextChoices):
    HAPPENED = "happened", "It happened (keep its result, do not repeat)"
    NOT_HAPPENED = "not_happened", "It did not happen (perform it again, same key)"
    SKIP = "skip", "Skip it (continue without it)"
    ABORT_TASK = "abort_task", "Abort the task"
    APPROVE = "approve", "Approve (the call runs, through the WAL)"
    EDIT_APPROVE = "edit_approve", "Edit the arguments and approve"
    REJECT = "reject", "Reject (the note is the tool's result the model reads)"


DECISIONS_BY_KIND = {
    ReviewKind.EFFECT: (Decision.HAPPENED, Decision.NOT_HAPPENED, Decision.SKIP, Decision.ABORT_TASK),
    ReviewKind.APPROVAL: (Decision.APPROVE, Decision.EDIT_APPROVE, Decision.REJECT),
}


class ReviewItem(models.Model):
    task = models.ForeignKey("orchestrator.Task", on_delete=models.CASCADE, related_name="review_items")
    kind = models.CharField(max_length=20, choices=ReviewKind.choices, default=ReviewKind.EFFECT)
    wal_entry = models.OneToOneField("orchestrator.WalEntry", on_delete=models.CASCADE, related_name="review_item",
                                     null=True, blank=True)
    # An approval: the step that asked and the call it proposes {"tool", "arguments", "call_id", "context"}.
    step_id = models.CharField(max_length=200, blank=True)
    proposal = models.JSONField(null=True, blank=True)
    # The tool the item is about (its WAL entry's, or the proposal's), kept on the row so the
    # queue filters by tool without reading a WAL row per item. Filled by save().
    tool = models.CharField(max_length=100, blank=True)
    status = models.CharField(max_length=20, choices=ReviewStatus.choices, default=ReviewStatus.OPEN)
    # Why it is in doubt: which worker died, when, and what recovery saw.
    reason = models.TextField()
    dead_worker = models.CharField(max_length=200, blank=True)
    detected_at = models.DateTimeField(auto_now_add=True)
    evidence = models.JSONField(null=True, blank=True)
    decision = models.CharField(max_length=20, choices=Decision.choices, blank=True)
    decision_result = models.JSONField(null=True, blank=True)
    note = models.TextField(blank=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="review_decisions")
    decided_at = models.DateTimeField(null=True, blank=True)
    # --- approvals only (review.services, engine/approvals.py) ---
    # The deadline: past it, the sweeper applies `on_expiry` (expire_due_approvals).
    expires_at = models.DateTimeField(null=True, blank=True)
    on_expiry = models.CharField(max_length=20, choices=OnExpiry.choices, blank=True)
    escalate_to = models.CharField(max_length=150, blank=True)  # a group name, for on_expiry=escalate
    expired_at = models.DateTimeField(null=True, blank=True)  # the deadline passed (whatever the fallback)
    # Escalated: from then on only reviewers in `escalate_to` (and admins) may decide it.
    escalated_at = models.DateTimeField(null=True, blank=True)
    # Two-person approval: how many different reviewers must approve the same arguments.
    approvals_required = models.PositiveSmallIntegerField(default=1)

    class Meta:
        # The engine owns the class and every write that opens or closes an item
        # (orchestrator/engine/reviews.py, approvals.py); the table, its migrations and the
        # admin's /admin/review/reviewitem/ stay under the review app's label, as before.
        app_label = "review"
        ordering = ["detected_at", "id"]
        indexes = [models.Index(fields=["status", "detected_at"], name="review_status_detected"),
                   # The admin's list of every item, in this ordering (without it: a sort after a join).
                   models.Index(fields=["detected_at", "id"], name="review_detected_id"),
                   # The sweeper's question every pass: open approvals past their deadline.
                   models.Index(fields=["status", "expires_at"], name="review_status_expires")]

    def __str__(self):
        return f"review #{self.pk} task {self.task_id} {self.tool} ({self.status})"

    def save(self, *args, **kwargs):
        if not self.tool:
            self.tool = self.wal_entry.tool if self.wal_entry_id else (self.proposal or {}).get("tool", "")
        super().save(*args, **kwargs)

    @property
    def step(self) -> str:
        return self.wal_entry.step_id if self.wal_entry_id else self.step_id
