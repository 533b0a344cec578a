"""The egress policy of the agent's HTTP requests (`http.request` with `"egress": "policy"`),
against real servers on this machine: what is refused is refused before any connection,
the name is resolved once and the connection goes to the checked address, every redirect
is checked again, and the caps hold. docs/egress.md."""
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.primitives.cancellation import CancellationToken
from orchestrator.tools import egress
from orchestrator.tools.base import OutcomeUnknown, ToolError
from orchestrator.tools.catalog import get_tool
from orchestrator.tools.http import http_call

POLICED = {"egress": "policy"}


class Handler(BaseHTTPRequestHandler):
    """/ok, /big?size=N, /redirect?to=URL&status=302, /slow (no answer until released),
    /drip (the status, then a byte at a time until released); /echo answers the request."""

    def log_message(self, *args):
        pass

    def _route(self):
        server = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        path, _, query = self.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query))
        server.requests.append({"method": self.command, "path": path, "target": self.path,
                                "host": self.headers.get("Host"),
                                "body": body, "authorization": self.headers.get("Authorization")})
        if path == "/redirect":
            self.send_response(int(params.get("status", 302)))
            self.send_header("Location", params["to"])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/big":
            payload = b"x" * int(params["size"])
            self._answer(payload)
        elif path == "/slow":
            server.release.wait(30)
            self._answer(b"late")
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            while not server.release.wait(0.05):
                try:
                    self.wfile.write(b"d")
                    self.wfile.flush()
                except OSError:
                    return
        elif path == "/echo":
            self._answer(json.dumps({"method": self.command, "body": body.decode()}).encode())
        else:
            self._answer(b"hello")

    def _answer(self, payload: bytes):
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_HEAD = _route


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host="127.0.0.1", family=socket.AF_INET):
        self.address_family = family
        super().__init__((host, 0), Handler)
        self.requests = []
        self.release = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path="/ok", host="127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def stop(self):
        self.release.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def server():
    running = Server()
    yield running
    running.stop()


@pytest.fixture
def other_server():
    running = Server()
    yield running
    running.stop()


@pytest.fixture
def connections(monkeypatch):
    """Every TCP connection this process attempts (its address), from now on."""
    attempts = []
    original = socket.socket.connect

    def connect(sock, address):
        attempts.append(address)
        return original(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.fixture(autouse=True)
def defaults(settings):
    settings.ORCH_HTTP_ALLOW = []
    settings.ORCH_HTTP_TIMEOUT_SECONDS = 10.0
    settings.ORCH_HTTP_MAX_RESPONSE_BYTES = 1_000_000
    settings.ORCH_HTTP_MAX_REQUEST_BYTES = 1_000_000


def policed(url, **args):
    return http_call({"method": "GET", "url": url, **POLICED, **args}, token=CancellationToken())


def perform(url, **args):
    """Through the tool, as ctx.effect performs it (validate, then perform)."""
    tool = get_tool("http.request")
    call = {"method": "GET", "url": url, **POLICED, **args}
    tool.validate(call)
    return tool.perform(call, key="k-1", token=CancellationToken())


def allow(settings, *entries):
    settings.ORCH_HTTP_ALLOW = list(entries)


# --- refused before any connection


@pytest.mark.parametrize("host, reason", [
    ("127.0.0.1", "loopback"),
    ("localhost", "loopback"),
    ("[::1]", "loopback"),
    ("0.0.0.0", "unspecified"),
    ("2130706433", "loopback"),  # 127.0.0.1 as a decimal number
    ("0x7f.1", "loopback"),  # and in hex, abbreviated
    ("0177.0.0.1", "loopback"),  # and in octal
    ("[::ffff:127.0.0.1]", "IPv6 form of 127.0.0.1"),
    ("10.1.2.3", "private"),
    ("192.168.0.10", "private"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("[fd00::1]", "private"),
    ("[fe80::1]", "link-local"),
    ("224.0.0.1", "multicast"),
    ("169.254.169.254", "cloud metadata address"),
    ("[fd00:ec2::254]", "cloud metadata address"),
    ("169.254.1.1", "link-local"),
])
def test_internal_destinations_are_refused_before_connecting(server, connections, host, reason):
    url = f"http://{host}:{server.port}/ok"
    with pytest.raises(ToolError) as refused:
        perform(url)
    message = str(refused.value)
    assert reason in message and "ORCH_HTTP_ALLOW=" in message, message
    assert connections == [] and server.requests == []


def test_a_refusal_says_which_entry_would_allow_it(server):
    with pytest.raises(egress.EgressRefused) as refused:
        policed(server.url("/ok", host="localhost"))
    assert "localhost resolves to 127.0.0.1, which is a loopback address" in str(refused.value)
    assert f"ORCH_HTTP_ALLOW=localhost:{server.port}" in str(refused.value)


def test_the_metadata_name_is_refused_whatever_it_resolves_to(monkeypatch, connections):
    resolved = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: resolved.append(a) or [])
    for name in ("metadata.google.internal", "Metadata.Google.Internal.", "metadata"):
        with pytest.raises(egress.EgressRefused, match="cloud metadata name"):
            policed(f"http://{name}/computeMetadata/v1/")
    assert resolved == [] and connections == []


@pytest.mark.parametrize("url, complaint", [
    ("http://user:secret@example.org/", "user name or password"),
    ("ftp://example.org/", "http(s) url"),
    ("file:///etc/passwd", "http(s) url"),
    ("http://example.org:99999/", "Port out of range"),
])
def test_urls_the_policy_cannot_judge_are_refused_before_the_intent(url, complaint, connections):
    with pytest.raises(ToolError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        get_tool("http.request").validate({"url": url, **POLICED})
    assert connections == []


def test_an_unknown_egress_mode_is_refused_not_taken_as_no_policy(server):
    with pytest.raises(ToolError, match="unknown egress mode"):
        http_call({"url": server.url(), "egress": "open"}, token=CancellationToken())
    assert server.requests == []


def test_a_public_looking_name_that_resolves_to_loopback_is_refused(monkeypatch, server, connections):
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.0.1" if host == "api.example.com" else host, *a, **k))
    with pytest.raises(egress.EgressRefused, match="api.example.com resolves to 127.0.0.1"):
        policed(f"http://api.example.com:{server.port}/ok")
    assert connections == [] and server.requests == []


def test_a_name_with_one_internal_answer_among_public_ones_is_refused(monkeypatch, connections):
    def resolver(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with pytest.raises(egress.EgressRefused, match="resolves to 10.0.0.5, which is a private address"):
        policed("http://mixed.example.com/")
    assert connections == []


def test_dns_rebinding_gets_one_resolution_and_the_connection_goes_to_the_checked_address(monkeypatch, connections):
    """The resolver answers a public address first and 127.0.0.1 after: the request is made
    to the public one (nothing listens there: refused), never to 127.0.0.1."""
    answers = iter(["93.184.216.34", "127.0.0.1", "127.0.0.1"])
    questions = []

    def resolver(host, port, *args, **kwargs):
        questions.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    def refuse(sock, address):
        connections.append(address)
        raise ConnectionRefusedError("nobody listens here")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(ToolError, match="failed before it reached the server"):
        policed("http://rebind.example.com:8080/")
    assert questions == ["rebind.example.com"]
    assert connections == [("93.184.216.34", 8080)]


def test_the_pinned_connection_keeps_the_name_for_the_host_header(monkeypatch, server, settings):
    """Connected to the checked address, the request still names the host it was written with."""
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.0.1" if host == "intranet.example.com" else host, *a, **k))
    allow(settings, f"intranet.example.com:{server.port}")
    result = policed(f"http://intranet.example.com:{server.port}/ok")
    assert result["status"] == 200 and result["body"] == "hello"
    assert server.requests[0]["host"] == f"intranet.example.com:{server.port}"


def _certificate_authority(tmp_path, name):
    """A CA and a certificate for `name` it signed (files: ca.pem, cert.pem, key.pem)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject, issuer, key, signer, *, ca):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egress test CA")])
    ca = issue(ca_name, ca_name, ca_key, ca_key, ca=True)
    cert = issue(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca_name, key, ca_key, ca=False)
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return tmp_path


@pytest.fixture
def tls_server(tmp_path, monkeypatch):
    """An HTTPS server for secure.example.com on 127.0.0.1 (the names resolve there), whose CA
    this process trusts; `sni` lists the names clients asked for."""
    import ssl

    files = _certificate_authority(tmp_path, "secure.example.com")
    running = Server()
    running.sni = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files / "cert.pem", files / "key.pem")
    context.sni_callback = lambda sock, name, ctx: running.sni.append(name)
    running.socket = context.wrap_socket(running.socket, server_side=True)
    monkeypatch.setattr(ssl, "_create_default_https_context",
                        lambda: ssl.create_default_context(cafile=str(files / "ca.pem")))
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real(
        "127.0.0.1" if host.endswith(".example.com") else host, *a, **k))
    yield running
    running.stop()


def test_https_to_the_pinned_address_still_verifies_the_certificate_for_the_name(tls_server, settings):
    allow(settings, f"secure.example.com:{tls_server.port}", f"other.example.com:{tls_server.port}")
    result = policed(f"https://secure.example.com:{tls_server.port}/ok")
    assert result["body"] == "hello" and tls_server.sni == ["secure.example.com"]
    assert tls_server.requests[0]["host"] == f"secure.example.com:{tls_server.port}"
    with pytest.raises(ToolError, match="failed before it reached the server.*CERTIFICATE_VERIFY_FAILED"):
        policed(f"https://other.example.com:{tls_server.port}/ok")  # same address, a name the certificate lacks
    assert len(tls_server.requests) == 1


# --- allowed by ORCH_HTTP_ALLOW


def test_a_listed_host_port_is_reached(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    assert perform(server.url())["body"] == "hello"
    assert [r["path"] for r in server.requests] == ["/ok"]


def test_the_allow_list_is_exact_about_host_and_port(server, other_server, settings, connections):
    allow(settings, f"127.0.0.1:{other_server.port}", "127.0.0.1", f"localhost:{server.port}")
    with pytest.raises(egress.EgressRefused):  # another port; an entry without a port allows nothing
        policed(server.url())
    with pytest.raises(egress.EgressRefused):  # the name is allowed, the address written instead is not
        policed(server.url(host="127.0.0.1"))
    assert connections == [] and server.requests == other_server.requests == []


def test_a_listed_address_allows_the_names_that_resolve_to_it(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    assert policed(server.url(host="localhost"))["status"] == 200


def test_a_listed_name_allows_what_it_resolves_to(server, settings):
    allow(settings, f"LOCALHOST:{server.port}")
    assert policed(server.url(host="localhost"))["status"] == 200


def test_an_ipv6_loopback_server_is_reached_when_listed(settings):
    v6 = Server("::1", socket.AF_INET6)
    try:
        allow(settings, f"[::1]:{v6.port}")
        assert policed(f"http://[::1]:{v6.port}/ok")["body"] == "hello"
    finally:
        v6.stop()


def test_a_url_written_as_text_is_percent_encoded_not_refused(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    assert policed(server.url('/echo?q=a b "c"&name=Zoë&done=100%25'))["status"] == 200
    assert server.requests[0]["target"] == "/echo?q=a%20b%20%22c%22&name=Zo%C3%AB&done=100%25"


def test_without_the_flag_operator_steps_reach_local_servers(server):
    result = http_call({"method": "GET", "url": server.url()}, token=CancellationToken())
    assert result == {"status": 200, "body": "hello", "truncated": False}


# --- redirects


def test_a_redirect_from_an_allowed_server_to_an_unlisted_one_is_refused(server, other_server, settings, connections):
    allow(settings, f"127.0.0.1:{server.port}")
    with pytest.raises(egress.EgressRefused) as refused:
        perform(server.url(f"/redirect?to={other_server.url('/secret')}"))
    message = str(refused.value)
    assert "redirected to" in message and f"ORCH_HTTP_ALLOW=127.0.0.1:{other_server.port}" in message
    assert [r["path"] for r in server.requests] == ["/redirect"] and other_server.requests == []
    assert connections == [("127.0.0.1", server.port)]


def test_a_redirect_to_the_metadata_address_is_refused(server, settings, connections):
    allow(settings, f"127.0.0.1:{server.port}")
    with pytest.raises(egress.EgressRefused, match="169.254.169.254 is a cloud metadata address"):
        policed(server.url("/redirect?to=http://169.254.169.254/latest/meta-data/"))
    assert connections == [("127.0.0.1", server.port)]


def test_redirects_between_listed_servers_are_followed_and_say_where_they_led(server, other_server, settings):
    allow(settings, f"127.0.0.1:{server.port}", f"127.0.0.1:{other_server.port}")
    result = policed(server.url(f"/redirect?to={other_server.url('/ok')}"), headers={"Authorization": "Bearer t"})
    assert result["status"] == 200 and result["body"] == "hello" and result["url"] == other_server.url("/ok")
    assert server.requests[0]["authorization"] == "Bearer t"
    assert other_server.requests[0]["authorization"] is None  # credentials stay with their origin


@pytest.mark.parametrize("status, method, body", [(302, "GET", ""), (303, "GET", ""), (307, "POST", '{"a": 1}'),
                                                  (308, "POST", '{"a": 1}'), (301, "GET", "")])
def test_a_redirected_post_follows_the_usual_rules(server, settings, status, method, body):
    allow(settings, f"127.0.0.1:{server.port}")
    target = urllib.parse.quote(server.url("/echo"), safe="")
    result = policed(server.url(f"/redirect?status={status}&to={target}"), method="POST", json={"a": 1})
    assert json.loads(result["body"]) == {"method": method, "body": body}


def test_more_than_five_redirects_are_not_followed(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    url = server.url("/ok")  # wrapped in six redirects, each one more level of quoting
    for _ in range(6):
        url = server.url("/redirect?to=" + urllib.parse.quote(url, safe=""))
    with pytest.raises(ToolError, match="more than 5 redirects"):
        policed(url)
    assert len(server.requests) == 6


def test_the_policy_ignores_proxy_settings_of_the_environment(server, settings, monkeypatch, connections):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")  # a proxy would see the request, not the policy
    allow(settings, f"127.0.0.1:{server.port}")
    assert policed(server.url())["status"] == 200
    assert connections == [("127.0.0.1", server.port)]


# --- caps


def test_a_response_bigger_than_the_cap_is_cut_and_marked(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    settings.ORCH_HTTP_MAX_RESPONSE_BYTES = 1000
    result = policed(server.url("/big?size=500000"))
    assert result["truncated"] is True and len(result["body"]) == 1000
    assert "ORCH_HTTP_MAX_RESPONSE_BYTES" in result["stopped_by"]
    exact = policed(server.url("/big?size=1000"))
    assert exact["truncated"] is False and len(exact["body"]) == 1000 and "stopped_by" not in exact


def test_a_request_body_over_the_cap_is_refused_before_the_intent(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    settings.ORCH_HTTP_MAX_REQUEST_BYTES = 100
    with pytest.raises(ToolError, match="ORCH_HTTP_MAX_REQUEST_BYTES"):
        get_tool("http.request").validate({"method": "POST", "url": server.url(), "json": {"x": "y" * 200}, **POLICED})
    with pytest.raises(ToolError, match="at most 100 bytes"):
        policed(server.url("/echo"), method="POST", body="z" * 101)
    assert server.requests == []
    assert policed(server.url("/echo"), method="POST", body="z" * 100)["status"] == 200


def test_a_server_that_does_not_answer_in_time_is_cut_off_as_outcome_unknown(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    settings.ORCH_HTTP_TIMEOUT_SECONDS = 0.5
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown) as unknown:
        perform(server.url("/slow"), method="POST", json={"charge": 1})
    assert time.monotonic() - started < 5
    assert "the request was sent but no answer came" in str(unknown.value)
    assert len(server.requests) == 1


def test_a_body_that_drips_past_the_time_limit_is_cut_and_marked(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    settings.ORCH_HTTP_TIMEOUT_SECONDS = 0.6
    started = time.monotonic()
    result = policed(server.url("/drip"))
    assert time.monotonic() - started < 5
    assert result["status"] == 200 and result["truncated"] is True and result["body"].startswith("d")
    assert "ORCH_HTTP_TIMEOUT_SECONDS" in result["stopped_by"]


def test_the_time_limit_is_the_smaller_of_the_call_and_the_setting(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    settings.ORCH_HTTP_TIMEOUT_SECONDS = 30
    started = time.monotonic()
    with pytest.raises(OutcomeUnknown):
        policed(server.url("/slow"), timeout=0.3)
    assert time.monotonic() - started < 5


def test_cancelling_a_policed_request_in_flight_is_outcome_unknown(server, settings):
    allow(settings, f"127.0.0.1:{server.port}")
    token = CancellationToken()
    threading.Thread(target=lambda: (_wait_for_request(server), token.cancel("operator stop")), daemon=True).start()
    with pytest.raises(OutcomeUnknown, match="cancelled"):
        get_tool("http.request").perform({"method": "POST", "url": server.url("/slow"), **POLICED},
                                         key="k", token=token)


def _wait_for_request(server):
    from tests.conftest import wait_for

    wait_for(lambda: server.requests, timeout=10, message="the request to arrive")


# --- address classification


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:4700::1111", "8.8.8.8"])
def test_public_addresses_pass(address):
    import ipaddress

    assert egress.why_forbidden(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize("address", ["::ffff:10.0.0.1", "2002:7f00:1::", "64:ff9b::a9fe:a9fe", "::", "ff02::1",
                                     "192.0.2.1", "::1", "100.127.255.255"])
def test_internal_addresses_in_any_dress_are_forbidden(address):
    import ipaddress

    assert egress.why_forbidden(ipaddress.ip_address(address))


# --- through the WAL, as the agent's tool call runs


@pytest.mark.django_db(transaction=True)
def test_a_refused_call_through_the_wal_is_not_performed_and_says_how_to_allow_it(server, settings):
    from orchestrator.engine import services
    from orchestrator.engine.worker import drive_inline
    from orchestrator.models import Task, WalEntry

    settings.ORCH_EXTRA_TASK_TYPES = ["tests.security.egress_types"]
    task = services.task_create(type="test.policed_fetch", params={"url": server.url("/ok")})
    drive_inline(task.pk)
    entry = WalEntry.objects.get(task=task)
    assert entry.status == "failed" and f"ORCH_HTTP_ALLOW=127.0.0.1:{server.port}" in entry.error
    assert server.requests == []
    assert Task.objects.get(pk=task.pk).status in ("needs_human", "failed")

    allow(settings, f"127.0.0.1:{server.port}")
    allowed = services.task_create(type="test.policed_fetch", params={"url": server.url("/ok")})
    drive_inline(allowed.pk)
    assert Task.objects.get(pk=allowed.pk).status == "completed"
    assert WalEntry.objects.get(task=allowed).status == "done" and len(server.requests) == 1
