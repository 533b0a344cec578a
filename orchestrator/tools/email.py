"""email.send over SMTP (EMAIL_HOST/EMAIL_PORT, EMAIL_USE_TLS/SSL, EMAIL_HOST_USER). Not
idempotent: a second send is a second email.

The SMTP conversation is driven step by step so a failure says which side of the line it
fell on. Everything up to the server's 354 to DATA (connect, EHLO, TLS, login, MAIL, RCPT,
DATA) is *not performed*: the server has accepted nothing, the step may retry. Once the
message body is on the wire the server may take it at any moment; a disconnect or a
timeout before its final reply is *outcome unknown* and goes to a reviewer. A 4xx/5xx final
reply is a refusal (not performed).

The idempotency key travels in the Message-ID and an X-Idempotency-Key header, so a
reviewer (or the receiving side) can look for it."""
import re
import smtplib
import ssl

from django.conf import settings
from django.core.mail import EmailMessage

from ..primitives.faults import fault_point_for_key
from .base import OutcomeUnknown, Tool, ToolError, register

ADDRESS = re.compile(r"^[^@\s]+@[^@\s]+$")
LEADING_DOT = re.compile(rb"(?m)^\.")


def message_id(key: str) -> str:
    return f"<{re.sub(r'[^A-Za-z0-9.-]', '.', key)}@orchestrator>"


def server() -> str:
    return f"{settings.EMAIL_HOST}:{settings.EMAIL_PORT}"


def deliver(message: EmailMessage, *, key: str, timeout: float) -> None:
    """Send one message; raise ToolError (not performed) or OutcomeUnknown."""
    sender, recipients = message.from_email, message.recipients()
    payload = message.message().as_bytes(linesep="\r\n")
    phase = "connect"
    smtp = None
    try:
        smtp_class = smtplib.SMTP_SSL if settings.EMAIL_USE_SSL else smtplib.SMTP
        smtp = smtp_class(settings.EMAIL_HOST, settings.EMAIL_PORT, timeout=timeout)
        phase = "EHLO"
        smtp.ehlo_or_helo_if_needed()
        if settings.EMAIL_USE_TLS:
            phase = "STARTTLS"
            smtp.starttls(context=ssl.create_default_context())
            smtp.ehlo()
        if settings.EMAIL_HOST_USER:
            phase = "AUTH"
            smtp.login(settings.EMAIL_HOST_USER, settings.EMAIL_HOST_PASSWORD)
        fault_point_for_key("during_effect", key)  # crash tests: connected, nothing sent
        phase = "MAIL FROM"
        code, reply = smtp.mail(sender)
        if code != 250:
            raise ToolError(f"SMTP {server()} refused MAIL FROM:<{sender}> ({code} {_text(reply)}); nothing was sent")
        phase = "RCPT TO"
        for recipient in recipients:
            code, reply = smtp.rcpt(recipient)
            if code not in (250, 251):
                # All or nothing: sending to the accepted recipients only would make a retry
                # send them a second copy.
                raise ToolError(f"SMTP {server()} refused recipient {recipient} ({code} {_text(reply)}); "
                                f"nothing was sent")
        phase = "DATA"
        smtp.putcmd("data")
        code, reply = smtp.getreply()
        if code != 354:
            raise ToolError(f"SMTP {server()} refused DATA ({code} {_text(reply)}); nothing was sent")
    except ToolError:
        _close(smtp)
        raise
    except (OSError, smtplib.SMTPException) as exc:
        _close(smtp)
        raise ToolError(f"SMTP {server()} failed at {phase} ({type(exc).__name__}: {exc}); nothing was sent") from exc

    # From here on the server may accept the message at any moment.
    body = LEADING_DOT.sub(b"..", payload)
    if not body.endswith(b"\r\n"):
        body += b"\r\n"
    try:
        smtp.send(body + b".\r\n")
        code, reply = smtp.getreply()
    except (OSError, smtplib.SMTPException) as exc:
        _close(smtp)
        raise OutcomeUnknown(
            f"SMTP {server()}: the message was sent but the server's answer never came "
            f"({type(exc).__name__}: {exc or 'connection closed'}); it may or may not have been accepted",
            evidence={"phase": "after DATA", "error": f"{type(exc).__name__}: {exc}", "timeout_seconds": timeout},
        ) from exc
    _quit(smtp)
    if code != 250:
        raise ToolError(f"SMTP {server()} refused the message after DATA ({code} {_text(reply)})")


def _text(reply) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


def _quit(smtp) -> None:
    try:
        smtp.quit()
    except (OSError, smtplib.SMTPException):
        _close(smtp)


def _close(smtp) -> None:
    if smtp is not None:
        try:
            smtp.close()
        except OSError:
            pass


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
        with token.track("smtp", f"email to {', '.join(recipients)[:100]}"):
            deliver(msg, key=key, timeout=settings.EMAIL_TIMEOUT)
        return {"sent": 1, "message_id": message_id(key), "to": recipients}

    def confirmed_result(self, args: dict, *, key: str) -> dict:
        recipients = [args["to"]] if isinstance(args.get("to"), str) else list(args.get("to") or [])
        return {"sent": 1, "message_id": message_id(key), "to": recipients, "confirmed_by_reviewer": True}

    def repeat_consequence(self, args: dict, *, idempotent: bool) -> str:
        to = args.get("to")
        return f"will be sent again to {', '.join(to) if isinstance(to, list) else to}"

    def evidence(self, args: dict, *, key: str) -> dict:
        return {"message_id": message_id(key), "header": f"X-Idempotency-Key: {key}",
                "to": args.get("to"), "subject": args.get("subject"),
                "how_to_check": f"Look for Message-ID {message_id(key)} in the recipient's mailbox or the "
                                f"SMTP server's log ({server()}). Found: "
                                f"'happened'. Not found: 'not_happened' (it is sent again with the same Message-ID)."}
