"""API bearer tokens: `manage.py apitoken USER` prints one; only its SHA-256 is stored."""
import hashlib
import secrets

from django.utils import timezone

from .models import ApiToken

TOKEN_PREFIX = "orch_"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def token_issue(*, user) -> str:
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    ApiToken.objects.create(user=user, token_hash=hash_token(raw), prefix=raw[:12])
    return raw


def token_user(raw: str):
    """The active user a raw token belongs to, or None."""
    token = ApiToken.objects.select_related("user").filter(token_hash=hash_token(raw)).first()
    if token is None or not token.user.is_active:
        return None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return token.user
