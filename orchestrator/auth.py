"""API bearer tokens: `manage.py apitoken USER [--expires-in-days N]` prints one; only its
SHA-256 is stored. A token may expire (`expires_at`); an expired one is refused."""
import hashlib
import secrets
from datetime import timedelta

from django.utils import timezone

from .models import ApiToken
from .primitives.errors import HarnessError

TOKEN_PREFIX = "orch_"


class TokenRejected(HarnessError):
    """A bearer token that does not authenticate anyone; the message says why."""


# "Last used" is kept to the minute: a write (and a commit) on every request made the token's
# row a lock every concurrent client of one token queued on (bench/compare.py: a fifth of
# POST /api/tasks's time in 8 clients' creation of 1,000 tasks).
LAST_USED_RESOLUTION = timedelta(minutes=1)


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def token_issue(*, user, expires_in_days: float | None = None) -> str:
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days is not None else None
    ApiToken.objects.create(user=user, token_hash=hash_token(raw), prefix=raw[:12], expires_at=expires_at)
    return raw


def token_authenticate(raw: str):
    """The active user a raw token belongs to; TokenRejected says why there is none."""
    token = ApiToken.objects.select_related("user").filter(token_hash=hash_token(raw)).first()
    if token is None:
        raise TokenRejected("Invalid bearer token: it is unknown or was revoked. "
                            "Create a new one with `manage.py apitoken USERNAME`.")
    now = timezone.now()
    if token.is_expired(now):
        raise TokenRejected(f"Token expired: bearer token {token.prefix}… expired at "
                            f"{token.expires_at:%Y-%m-%d %H:%M:%S} UTC. Create a new one with "
                            "`manage.py apitoken USERNAME [--expires-in-days N]`.")
    if not token.user.is_active:
        raise TokenRejected("Bearer token of a deactivated user: ask an administrator to reactivate the account.")
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token.user
