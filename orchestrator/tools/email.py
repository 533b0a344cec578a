"""email.send over SMTP (EMAIL_HOST/EMAIL_PORT). Not idempotent: a crash while sending
leaves it unknown whether the message went out, which only a reviewer can settle.
The idempotency key travels in the Message-ID and an X-Idempotency-Key header, so a
reviewer (or the receiving side) can look for it."""
import re

from django.conf import settings
from django.core.mail import EmailMessage, get_connection

from ..engine.faults import fault_point_for_key
from .base import Tool, ToolError, register

ADDRESS = re.compile(r"^[^@\s]+@[^@\s]+$")


def message_id(key: str) -> str:
    return f"<{re.sub(r'[^A-Za-z0-9.-]', '.', key)}@orchestrator>"


@register
class EmailSend(Tool):
    name = "email.send"
    description = "Send one email over SMTP: {to, subject, body}."
    idempotent = False

    def validate(self, args: dict) -> None:
        recipients = args.get("to")
        if isinstance(recipients, str):
            recipients = [recipients]
        if not recipients or not all(ADDRESS.match(r or "") for r in recipients):
            raise ToolError(f"email.send needs valid recipient addresses in 'to'; got {args.get('to')!r}")

    def perform(self, args: dict, *, key: str, token) -> dict:
        token.raise_if_cancelled()
        recipients = [args["to"]] if isinstance(args["to"], str) else list(args["to"])
        msg = EmailMessage(subject=args.get("subject", ""), body=args.get("body", ""),
                           from_email=args.get("from") or settings.DEFAULT_FROM_EMAIL, to=recipients,
                           headers={"Message-ID": message_id(key), "X-Idempotency-Key": key})
        try:
            with get_connection(fail_silently=False, timeout=settings.EMAIL_TIMEOUT) as connection:
                fault_point_for_key("during_effect", key)  # crash tests: connected, not yet sent
                sent = connection.send_messages([msg])
        except (OSError, Exception) as exc:
            raise ToolError(f"SMTP {settings.EMAIL_HOST}:{settings.EMAIL_PORT} refused the message: {exc}") from exc
        return {"sent": sent, "message_id": message_id(key), "to": recipients}

    def confirmed_result(self, args: dict, *, key: str) -> dict:
        recipients = [args["to"]] if isinstance(args.get("to"), str) else list(args.get("to") or [])
        return {"sent": 1, "message_id": message_id(key), "to": recipients, "confirmed_by_reviewer": True}

    def evidence(self, args: dict, *, key: str) -> dict:
        return {"message_id": message_id(key), "header": f"X-Idempotency-Key: {key}",
                "to": args.get("to"), "subject": args.get("subject"),
                "how_to_check": f"Look for Message-ID {message_id(key)} in the recipient's mailbox or the "
                                f"SMTP server's log ({settings.EMAIL_HOST}:{settings.EMAIL_PORT}). Found: "
                                f"'happened'. Not found: 'not_happened' (it is sent again with the same Message-ID)."}
