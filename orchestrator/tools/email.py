"""email.send over SMTP (EMAIL_HOST/EMAIL_PORT). Not idempotent: a crash while sending
leaves it unknown whether the message went out, which only a reviewer can settle.
The idempotency key travels in the Message-ID and an X-Idempotency-Key header, so a
reviewer (or the receiving side) can look for it."""
import re

from django.conf import settings
from django.core.mail import EmailMessage, get_connection

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
                sent = connection.send_messages([msg])
        except (OSError, Exception) as exc:
            raise ToolError(f"SMTP {settings.EMAIL_HOST}:{settings.EMAIL_PORT} refused the message: {exc}") from exc
        return {"sent": sent, "message_id": message_id(key), "to": recipients}
