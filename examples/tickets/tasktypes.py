"""tickets.escalate: find a ticket with the title (a read), open it if there is none (keyed: a
replay after a crash does not open a second), comment on it (non-idempotent: an outcome in doubt
goes to a reviewer), then report. Every step is checkpointed; the tools run through the WAL."""
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.sdk import StepContext, StepSpec, TaskType, call_tool, register_task_type


class EscalateParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str = Field(..., min_length=1, max_length=200, description="The ticket's title (an open ticket with "
                                                                       "exactly this title is reused)")
    body: str = Field("", max_length=20_000, description="What happened, for a new ticket")
    comment: str = Field("", max_length=20_000, description="A comment to add (empty: none)")


@register_task_type
class Escalate(TaskType):
    name = "tickets.escalate"
    title = "Escalate to the ticket tracker"
    description = ("Finds the ticket with this title in the tracker (TICKETS_URL), opens it if there is none, and "
                   "adds the comment. Written only with orchestrator.sdk (examples/tickets).")
    Params = EscalateParams
    on_step_failure = "needs_human"

    def plan(self, params: EscalateParams) -> list[StepSpec]:
        steps = [StepSpec("find", title="Look for the ticket", reads=("title",)),
                 StepSpec("open", title="Open it if there is none", depends_on=("find",), reads=("title", "body"))]
        last = "open"
        if params.comment:
            steps.append(StepSpec("comment", title="Comment on it", depends_on=("open",), reads=("comment",)))
            last = "comment"
        steps.append(StepSpec("report", title="Report", depends_on=tuple(dict.fromkeys(("open", last)))))
        return steps

    def run_step(self, ctx: StepContext, step_id: str):
        p = ctx.params
        if step_id == "find":
            found = call_tool(ctx, "tickets_search", {"query": p.title})
            same = [t for t in found["tickets"] if t["title"] == p.title]
            return {"ticket": same[0] if same else None}
        if step_id == "open":
            existing = ctx.deps["find"]["ticket"]
            if existing is not None:
                return {"ticket": existing, "opened": False}
            return {"ticket": call_tool(ctx, "tickets_create", {"title": p.title, "body": p.body}), "opened": True}
        if step_id == "comment":
            ticket = ctx.deps["open"]["ticket"]
            return call_tool(ctx, "tickets_comment", {"ticket": ticket["id"], "text": p.comment})
        ticket = ctx.deps["open"]["ticket"]
        ctx.progress(f"ticket #{ticket['id']}", ticket=ticket["id"])
        return {"ticket": ticket["id"], "opened": ctx.deps["open"]["opened"],
                "comment": (ctx.deps.get("comment") or {}).get("number")}
