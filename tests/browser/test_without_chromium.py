"""The browser tests on a machine without Chromium: they are skipped by one guard that says how to
enable them, and a Playwright that failed to launch never poisons the rest of the session (its
event loop, left marked as running on the main thread, once made every later database test raise
SynchronousOnlyOperation). These tests need no browser, so they run everywhere."""
import asyncio

import pytest
from playwright.sync_api import Error as PlaywrightError

import tests.browser.conftest as browser_conftest
from tests.browser.conftest import chromium, chromium_missing

NEEDS_CHROMIUM = False  # the guard in conftest.py lets these run without a browser

NOWHERE = "/nonexistent/chromium"


def loop_set_on_this_thread():
    """The loop the policy holds for this thread (set_event_loop), without creating one."""
    return getattr(asyncio.get_event_loop_policy()._local, "_loop", None)


def test_the_guard_names_the_missing_binary_and_how_to_enable_the_tests(monkeypatch, tmp_path):
    binary = tmp_path / "chromium"
    monkeypatch.setattr(browser_conftest, "CHROMIUM", str(binary))
    reason = chromium_missing()
    assert reason is not None and "\n" not in reason
    assert str(binary) in reason and "apt-get install chromium" in reason and "CHROMIUM_PATH" in reason

    binary.write_text("#!/bin/sh\n")  # there, but not executable: still missing
    assert chromium_missing() is not None
    binary.chmod(0o755)
    assert chromium_missing() is None


def test_a_failed_launch_stops_playwright_and_leaves_no_event_loop():
    loop_before = loop_set_on_this_thread()
    with pytest.raises(PlaywrightError, match="doesn't exist at /nonexistent/chromium"):
        with chromium(NOWHERE):
            pytest.fail("Chromium launched from a path that does not exist")
    assert asyncio._get_running_loop() is None  # what Django's SynchronousOnlyOperation check reads
    assert loop_set_on_this_thread() is loop_before


@pytest.mark.django_db
def test_the_database_works_after_a_failed_launch_in_the_browser_fixture(browser, monkeypatch, django_user_model):
    monkeypatch.setattr(browser_conftest, "CHROMIUM", NOWHERE)
    monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE")  # the check the browser tests switch off: on here
    with pytest.raises(PlaywrightError, match="doesn't exist"):
        browser()
    django_user_model.objects.create_user("after-a-failed-launch", password="pw")
    assert django_user_model.objects.filter(username="after-a-failed-launch").count() == 1
