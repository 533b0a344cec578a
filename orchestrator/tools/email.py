"""email.send over SMTP (EMAIL_HOST/EMAIL_PORT, EMAIL_USE_TLS/SSL, EMAIL_HOST_USER). Not
idempotent: a second send is a second email.

The SMTP conversation is driven step by step so a failure says which side of the line it
fell on. Everything up to the server's 354 to DATA (connect, EHLO, TLS, login, MAIL, RCPT,
DATA) is *not performed*: the server has accepted nothing, the step may retry. Once the
message body is on the wire the server may take it at any moment; a disconnect or a
timeout before its final reply is *outcome unknown* and goes to a reviewer. A 4xx/5xx final
reply is a refusal (not performed).

The idempotency key travels in the Message-ID and an X-Idempotency-Key header, so a
reviewer (or the receiving side) can look for it.

With an IMAP account (EMAIL_IMAP_HOST, _PORT, _USE_SSL, _USER, _PASSWORD, _SENT_FOLDER) the
tool keeps a copy of every message in the account's Sent folder, and its probe looks a
message in doubt up there by Message-ID. SMTP does not store sent mail (only some providers'
submission servers file a copy themselves, e.g. Gmail: there you get two copies), so the
tool files it, and *before* sending, flagged \\Draft, so that the folder can answer:
- no copy: the send never began (the copy is filed first, and a send whose copy could not be
  filed is refused, not performed) → not done;
- a copy without \\Draft: the server accepted the message (the flag is cleared after its 250)
  → done;
- a copy still \\Draft: the worker stopped between filing it and recording the server's
  answer (during DATA, or just after) → unknown, a reviewer decides.
A copy of a message the server refused is flagged \\Deleted (not expunged: the folder may
hold the user's own deleted mail), and the lookup skips deleted copies."""
import imaplib
import logging
import re
import smtplib
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.core.mail import EmailMessage

from ..primitives.faults import fault_point_for_key
from .base import PROBE_TIMEOUT_SECONDS, OutcomeUnknown, ProbeResult, Tool, ToolError, register

log = logging.getLogger(__name__)
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


class SentFolder:
    """The Sent folder of the account in EMAIL_IMAP_* (one IMAP connection, selected)."""

    def __init__(self, imap: imaplib.IMAP4 | None, folder: str):
        self.imap, self.folder = imap, folder

    @classmethod
    def configured(cls) -> bool:
        return bool(settings.EMAIL_IMAP_HOST)

    @classmethod
    def describe(cls) -> str:
        return (f"the {settings.EMAIL_IMAP_SENT_FOLDER!r} folder of {settings.EMAIL_IMAP_USER or 'the account'} on "
                f"IMAP {settings.EMAIL_IMAP_HOST}:{settings.EMAIL_IMAP_PORT}")

    @classmethod
    @contextmanager
    def open(cls, *, timeout: float, readonly: bool = False) -> Iterator["SentFolder"]:
        """Connected, logged in, the folder selected; raises imaplib.IMAP4.error or OSError."""
        imap_class = imaplib.IMAP4_SSL if settings.EMAIL_IMAP_USE_SSL else imaplib.IMAP4
        imap = imap_class(settings.EMAIL_IMAP_HOST, settings.EMAIL_IMAP_PORT, timeout=timeout)
        try:
            imap.login(settings.EMAIL_IMAP_USER, settings.EMAIL_IMAP_PASSWORD)
            folder = _quoted(settings.EMAIL_IMAP_SENT_FOLDER)
            status, reply = imap.select(folder, readonly=readonly)
            if status != "OK" and not _exists(imap, folder):
                if readonly:
                    yield cls(None, folder)  # a new account's Sent folder: nothing was ever filed
                    return
                imap.create(folder)
                status, reply = imap.select(folder)
            if status != "OK":
                raise imaplib.IMAP4.error(f"cannot open the folder: {_text(reply[0] if reply else '')}")
            yield cls(imap, folder)
        finally:
            try:
                imap.logout()
            except (OSError, imaplib.IMAP4.error):
                pass

    def file(self, payload: bytes) -> None:
        """Keep a copy of a message about to be sent, flagged \\Draft until the server takes it."""
        status, reply = self.imap.append(self.folder, r"(\Draft \Seen)", imaplib.Time2Internaldate(time.time()),
                                         payload)
        if status != "OK":
            raise imaplib.IMAP4.error(f"APPEND refused: {_text(reply[0] if reply else '')}")

    def copies(self, message_id: str) -> list[tuple[bytes, bool]]:
        """The copies of a message (not deleted): (uid, still flagged \\Draft)."""
        if self.imap is None:
            return []
        status, reply = self.imap.uid("SEARCH", "UNDELETED", "HEADER", "Message-ID", f'"{message_id}"')
        uids = reply[0].split() if status == "OK" and reply and reply[0] else []
        if status != "OK":
            raise imaplib.IMAP4.error(f"SEARCH refused: {_text(reply[0] if reply else '')}")
        found = []
        for uid in uids:
            status, data = self.imap.uid("FETCH", uid, "(FLAGS)")
            flags = b" ".join(part if isinstance(part, bytes) else part[0] for part in data if part)
            found.append((uid, b"\\Draft" in imaplib.ParseFlags(flags)))
        return found

    def mark(self, message_id: str, *, sent: bool) -> None:
        """After the server's answer: sent → the copies lose \\Draft; refused → deleted."""
        for uid, draft in self.copies(message_id):
            if sent:
                self.imap.uid("STORE", uid, "-FLAGS.SILENT", r"(\Draft)")
            elif draft:
                self.imap.uid("STORE", uid, "+FLAGS.SILENT", r"(\Deleted)")


def _exists(imap: imaplib.IMAP4, folder: str) -> bool:
    status, listed = imap.list('""', folder)
    if status != "OK":
        raise imaplib.IMAP4.error(f"LIST refused: {_text(listed[0] if listed else '')}")
    return any(entry for entry in listed)


def _quoted(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
        filed = SentFolder.configured()
        if filed:
            self._file_copy(msg, key=key)
        with token.track("smtp", f"email to {', '.join(recipients)[:100]}"):
            try:
                deliver(msg, key=key, timeout=settings.EMAIL_TIMEOUT)
            except ToolError:
                if filed:
                    self._mark_copy(key, sent=False)
                raise
        if filed:
            self._mark_copy(key, sent=True)
        return {"sent": 1, "message_id": message_id(key), "to": recipients}

    def _file_copy(self, msg: EmailMessage, *, key: str) -> None:
        """Before sending: the probe's "no copy means never sent" holds only if no message
        leaves without its copy, so a copy that cannot be filed stops the send."""
        try:
            with SentFolder.open(timeout=settings.EMAIL_TIMEOUT) as folder:
                folder.file(msg.message().as_bytes(linesep="\r\n"))
        except (OSError, imaplib.IMAP4.error) as exc:
            raise ToolError(f"could not file a copy in {SentFolder.describe()} ({type(exc).__name__}: {exc}); "
                            f"nothing was sent (the copy is what lets recovery check a send in doubt)") from exc

    def _mark_copy(self, key: str, *, sent: bool) -> None:
        """After the server's answer. Never fails the call: a copy left \\Draft only makes a
        later probe answer unknown (a reviewer decides), while failing a sent message would
        send it again."""
        try:
            with SentFolder.open(timeout=settings.EMAIL_TIMEOUT) as folder:
                folder.mark(message_id(key), sent=sent)
        except (OSError, imaplib.IMAP4.error) as exc:
            log.warning("could not mark the copy of %s in %s as %s: %s", message_id(key), SentFolder.describe(),
                        "sent" if sent else "refused", exc)

    def wal_args(self, args: dict) -> dict:
        # Whether this send files its copy first: only then does "no copy" mean "never sent"
        # (an account configured after the send must not make the probe say not done).
        return {**args, "sent_copy": SentFolder.describe()} if SentFolder.configured() else args

    def probe(self, args: dict, *, key: str) -> ProbeResult:
        if not SentFolder.configured():
            return ProbeResult.unknown("no IMAP account is configured (EMAIL_IMAP_HOST): nothing to look in")
        if not args.get("sent_copy"):
            return ProbeResult.unknown("this send began before email.send filed copies in an IMAP Sent folder: "
                                       "its absence there proves nothing")
        if args["sent_copy"] != SentFolder.describe():
            return ProbeResult.unknown(f"the copy was filed in {args['sent_copy']}; the account is now "
                                       f"{SentFolder.describe()}: its absence there proves nothing")
        where, wanted = SentFolder.describe(), message_id(key)
        try:
            with SentFolder.open(timeout=PROBE_TIMEOUT_SECONDS, readonly=True) as folder:
                copies = folder.copies(wanted)
        except (OSError, imaplib.IMAP4.error) as exc:
            return ProbeResult.unknown(f"could not search {where} ({type(exc).__name__}: {exc})")
        if not copies:
            return ProbeResult.not_done(f"no copy of {wanted} in {where}: the send never began")
        if any(not draft for _, draft in copies):
            recipients = [args["to"]] if isinstance(args.get("to"), str) else list(args.get("to") or [])
            return ProbeResult.done({"sent": 1, "message_id": wanted, "to": recipients, "confirmed_by_probe": where},
                                    f"{wanted} is in {where}, marked sent: the server accepted it")
        return ProbeResult.unknown(f"{wanted} is in {where} but was never marked sent: the worker stopped between "
                                   f"filing the copy and the server's answer")

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
