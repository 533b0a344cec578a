"""The "Database unreachable" banner as a browser draws it (docs/recovery.md, Outages; docs/recovery-claims.md
row 78). The server's side (the socket says `outage: unreachable`, then `reachable`, around a
real PostgreSQL restart) is tests/engine/test_outages.py; here the page's socket is routed
through Playwright to the real daphne, and the test speaks as that server would, so what is
under test is static/orchestrator/live.js drawing it."""
import json

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_page_shows_the_outage_banner_while_the_server_says_the_database_is_away(stack, new_page, make_user):
    make_user("olga", "operator")
    page = new_page("olga")
    sockets = []

    def through_to_daphne(route):
        route.connect_to_server()  # live updates still flow from the real server
        sockets.append(route)

    page.route_web_socket("**/ws/**", through_to_daphne)
    page.goto("/")
    banner = page.get_by_test_id("outage-banner")
    expect(page.get_by_test_id("live-indicator")).to_have_attribute("data-state", "live")
    expect(banner).to_be_hidden()

    sockets[-1].send(json.dumps({"type": "outage", "database": "unreachable"}))
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("Database unreachable")
    sockets[-1].send(json.dumps({"type": "outage", "database": "reachable"}))
    expect(banner).to_be_hidden()

    # Refused at the handshake with the outage code (the server could not read the database):
    # the banner shows, and the page reconnects on its own.
    opened = len(sockets)
    sockets[-1].close(code=4503, reason="database unreachable")
    expect(banner).to_be_visible()
    expect(page.get_by_test_id("live-indicator")).to_have_attribute("data-state", "live", timeout=20_000)
    assert len(sockets) > opened
