"""The admin's model profiles: the key is a secret — taken in a field that never shows it
back, kept when the field is left empty, removed only when asked; the lists show only that
one is set; a name LLM_MODELS declares is refused; the audit of a save never holds the key."""
import json

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from orchestrator.models import AuditEntry, ModelProfile

pytestmark = pytest.mark.django_db

KEY = "sk-admin-profile-7f3e2d1c0b9a"
NEW_KEY = "sk-admin-profile-rotated-5566"


@pytest.fixture
def admin_client(client):
    client.force_login(User.objects.create_superuser("root", "root@example.org", "pw"))
    return client


def form(**fields) -> dict:
    return {"name": "gpu", "enabled": "on", "base_url": "http://gpu-1:8000/v1", "model": "Qwen/Qwen2.5-7B-Instruct",
            "api_key": "", "context_window": "8192", "price_input_per_million": "0.5",
            "price_output_per_million": "1.5", "price_cached_per_million": "", "supports_tools": "on",
            "supports_stream_options": "on", **fields}


def add_url() -> str:
    return reverse("admin:orchestrator_modelprofile_add")


def change_url(profile) -> str:
    return reverse("admin:orchestrator_modelprofile_change", args=[profile.pk])


def test_a_profile_added_in_the_admin_keeps_its_key_and_never_shows_it(admin_client):
    response = admin_client.post(add_url(), form(api_key=KEY))
    assert response.status_code == 302, response.context["adminform"].form.errors.as_text()
    profile = ModelProfile.objects.get(name="gpu")
    assert profile.api_key == KEY and profile.context_window == 8192
    for page in (admin_client.get(change_url(profile)), admin_client.get(reverse(
            "admin:orchestrator_modelprofile_changelist"))):
        html = page.content.decode()
        assert page.status_code == 200 and KEY not in html
    assert "set (…" + KEY[-4:] + ")" in html
    [entry] = AuditEntry.objects.filter(action="model_profile.save")
    assert entry.after["name"] == "gpu" and entry.after["key_set"] and KEY not in json.dumps(entry.after)


def test_an_empty_key_field_keeps_the_key_a_new_one_replaces_it_and_remove_clears_it(admin_client):
    profile = ModelProfile.objects.create(name="gpu", base_url="http://gpu-1:8000/v1", model="m", api_key=KEY)
    assert admin_client.post(change_url(profile), form(model="other")).status_code == 302
    profile.refresh_from_db()
    assert (profile.model, profile.api_key) == ("other", KEY)
    assert not AuditEntry.objects.get(action="model_profile.save").after["key_changed"]
    assert admin_client.post(change_url(profile), form(api_key=NEW_KEY)).status_code == 302
    profile.refresh_from_db()
    assert profile.api_key == NEW_KEY
    assert admin_client.post(change_url(profile), form(clear_api_key="on")).status_code == 302
    profile.refresh_from_db()
    assert profile.api_key == ""
    assert [e.after["key_changed"] for e in AuditEntry.objects.filter(action="model_profile.save").order_by("id")] == [
        False, True, True]


def test_a_short_key_shows_no_characters_at_all(admin_client):
    ModelProfile.objects.create(name="gpu", base_url="http://gpu-1:8000/v1", model="m", api_key="abc123xyz")
    html = admin_client.get(reverse("admin:orchestrator_modelprofile_changelist")).content.decode()
    assert "abc123xyz" not in html and "3xyz" not in html and ">set<" in html


def test_a_name_llm_models_declares_is_refused(admin_client, settings):
    settings.LLM_MODELS = json.dumps({"gpu": {"base_url": "http://gpu-9:8000/v1", "model": "m"}})
    response = admin_client.post(add_url(), form(api_key=KEY))
    assert response.status_code == 200 and "LLM_MODELS declares a profile named" in response.content.decode()
    assert not ModelProfile.objects.exists()
    response = admin_client.post(add_url(), form(name="bad name", api_key=KEY))
    assert response.status_code == 200 and not ModelProfile.objects.exists()
    assert KEY not in response.content.decode()  # a refused form does not echo the key either


def test_a_staff_user_given_every_permission_on_profiles_still_cannot_open_them(client, make_user):
    # A profile's base_url decides where its key is sent: a staff user who could change it would
    # have the key sent to a server of their choosing. Admins (superusers) only, viewing included,
    # whatever model permissions a staff user was given.
    from django.contrib.auth.models import Permission

    profile = ModelProfile.objects.create(name="gpu", base_url="http://gpu-1:8000/v1", model="m", api_key=KEY)
    staff = make_user("stan", "operator")
    staff.is_staff = True
    staff.save()
    staff.user_permissions.set(Permission.objects.filter(content_type__model="modelprofile"))
    assert staff.has_perm("orchestrator.change_modelprofile")  # what Django alone would let through
    client.force_login(staff)
    listing = reverse("admin:orchestrator_modelprofile_changelist")
    for url in (listing, add_url(), change_url(profile)):
        assert client.get(url).status_code == 403, url
    assert client.post(change_url(profile), form(base_url="http://attacker.example/v1")).status_code == 403
    assert ModelProfile.objects.get().base_url == "http://gpu-1:8000/v1"
    assert listing not in client.get(reverse("admin:index")).content.decode()
