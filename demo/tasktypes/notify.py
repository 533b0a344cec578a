"""demo.notify: one email per recipient over SMTP — the non-idempotent side effect whose
doubtful outcomes (a worker dying mid-send) go to the review queue."""
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.sdk import StepSpec, TaskType, register_task_type

ADDRESS = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$|^[^@\s]+@localhost$")


class NotifyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    recipients: list[str] = Field(..., min_length=1, max_length=1000, description="Email addresses, one email each")
    subject: str = Field(..., min_length=1, max_length=200)
    body: str = Field("", max_length=100_000)

    @field_validator("recipients")
    @classmethod
    def valid_addresses(cls, value: list[str]) -> list[str]:
        bad = [r for r in value if not ADDRESS.match(r.strip())]
        if bad:
            raise ValueError(f"not an email address: {', '.join(bad[:5])}")
        cleaned = [r.strip() for r in value]
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("a recipient is listed twice")
        return cleaned


@register_task_type
class Notify(TaskType):
    name = "demo.notify"
    title = "Send notifications"
    description = "Send one email per recipient over SMTP (non-idempotent: ambiguous sends go to review)."
    Params = NotifyParams

    def plan(self, params: NotifyParams) -> list[StepSpec]:
        return [StepSpec(f"send-{i:03d}", f"Email {address}", reads=("recipients", "subject", "body"))
                for i, address in enumerate(params.recipients, start=1)]

    def run_step(self, ctx, step_id: str):
        index = int(step_id.split("-")[1]) - 1
        to = ctx.params.recipients[index]
        result = ctx.effect("email.send", {"to": to, "subject": ctx.params.subject, "body": ctx.params.body})
        return {"to": to, "message_id": (result or {}).get("message_id")}
