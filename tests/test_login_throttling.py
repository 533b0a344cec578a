"""Login throttling (django-axes) on the login page and the admin, and the password rules."""
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

pytestmark = pytest.mark.django_db

LIMIT = 5


def login(client, username, password, url="/accounts/login/", ip="10.1.1.1"):
    return client.post(url, {"username": username, "password": password}, REMOTE_ADDR=ip)


def fail(client, username, times, **kwargs):
    for attempt in range(1, times + 1):
        response = login(client, username, "wrong-password", **kwargs)
        # The form again with its error; the LIMIT-th failure answers the lockout page.
        assert response.status_code == (429 if attempt == LIMIT else 200), attempt
        assert not response.wsgi_request.user.is_authenticated


def test_the_limit_is_five_failures_per_username_and_ip():
    assert settings.AXES_FAILURE_LIMIT == LIMIT
    assert settings.AXES_LOCKOUT_PARAMETERS == [["username", "ip_address"]]
    assert settings.AXES_COOLOFF_TIME == timedelta(minutes=15)


def test_after_five_wrong_passwords_even_the_right_one_is_refused(make_user):
    make_user("vera", "viewer")
    client = Client()
    fail(client, "vera", LIMIT)
    response = login(client, "vera", "pw")  # the 6th attempt, with the right password
    assert response.status_code == 429
    body = response.content.decode()
    assert "Too many failed logins" in body and "locked" in body and "0:15:00" in body
    assert "_auth_user_id" not in client.session


def test_the_lockout_is_per_username_and_ip(make_user):
    make_user("vera", "viewer")
    make_user("otto", "operator")
    fail(Client(), "vera", LIMIT)
    assert login(Client(), "vera", "pw").status_code == 429
    assert login(Client(), "otto", "pw").status_code == 302  # another user from that address
    assert login(Client(), "vera", "pw", ip="10.2.2.2").status_code == 302  # that user from elsewhere


def test_the_lockout_ends_after_the_cool_off(make_user):
    make_user("vera", "viewer")
    fail(Client(), "vera", LIMIT)
    assert login(Client(), "vera", "pw").status_code == 429
    AccessAttempt.objects.update(attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1))
    response = login(Client(), "vera", "pw")
    assert response.status_code == 302 and response["Location"] == settings.LOGIN_REDIRECT_URL


def test_fewer_failures_than_the_limit_do_not_lock_and_a_success_resets_them(make_user):
    make_user("vera", "viewer")
    fail(Client(), "vera", LIMIT - 1)
    assert login(Client(), "vera", "pw").status_code == 302
    fail(Client(), "vera", LIMIT - 1)  # counted from zero again
    assert login(Client(), "vera", "pw").status_code == 302


def test_the_admin_login_is_throttled_too(make_user):
    make_user("root", superuser=True)
    client = Client()
    for attempt in range(1, LIMIT + 1):
        assert login(client, "root", "wrong", url="/admin/login/").status_code == (429 if attempt == LIMIT else 200)
    assert login(client, "root", "pw", url="/admin/login/").status_code == 429


def test_force_login_and_bearer_tokens_are_not_affected(make_user, client):
    from orchestrator.auth import token_issue

    user = make_user("vera", "viewer")
    fail(Client(), "vera", LIMIT, ip="127.0.0.1")
    client.force_login(user)
    assert client.get("/").status_code == 200
    assert Client().get("/api/tasks", HTTP_AUTHORIZATION=f"Bearer {token_issue(user=user)}").status_code == 200


@pytest.mark.parametrize("password", ["pw", "password", "12345678901", "vera-example"])
def test_weak_passwords_are_rejected(make_user, password):
    user = make_user("vera", "viewer")
    with pytest.raises(ValidationError):
        validate_password(password, user)


def test_a_strong_password_is_accepted(make_user):
    validate_password("quiet-harbour-71-lantern", make_user("vera", "viewer"))
