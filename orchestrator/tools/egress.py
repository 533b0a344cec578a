"""Where an agent's HTTP request may go (the egress policy of `http.request` with
`"egress": "policy"`; docs/egress.md).

A destination is refused when its name, or any address the name resolves to, is not a
public address: loopback, private (RFC 1918, fc00::/7), link-local (169.254/16, fe80::/10),
multicast, unspecified, reserved, shared/CGNAT (100.64/10), an IPv6 form that embeds one of
those (IPv4-mapped, 6to4, Teredo, NAT64), or a cloud metadata name or address. The one way
in is `ORCH_HTTP_ALLOW`, which lists exact `host:port` pairs: the host as written in the URL,
or one of the addresses it resolves to. Ports are not policed: the policy is on addresses
(a public server on any port is as reachable from a browser).

The name is resolved once (`check`) and the connection goes to the addresses that were
checked (`pinned_connection`): a resolver that answers a public address to the check and
127.0.0.1 to the connection (DNS rebinding) gets no second question. TLS still verifies the
certificate for the name, and the Host header carries the name.

Address classification is the standard library's `ipaddress` (kept with Python itself);
the one PyPI package built for this (`advocate`, over `requests`) has had no release since
2020 and would bring a second HTTP client."""
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass

from django.conf import settings

from .base import ToolError

MAX_REDIRECTS = 5
DEFAULT_PORTS = {"http": 80, "https": 443}

# Names that lead to a cloud provider's instance metadata (credentials of the host's role),
# refused by name whatever the resolver answers.
METADATA_NAMES = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "metadata.azure.internal",
    "instance-data", "instance-data.ec2.internal", "metadata.tencentyun.com", "metadata.platformequinix.com",
})
# Their addresses, named in refusals (each is in a refused range anyway).
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(text) for text in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle
    "169.254.170.2",  # AWS ECS task credentials
    "fd00:ec2::254",  # AWS over IPv6
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud (classic)
))
SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
NAT64 = ipaddress.ip_network("64:ff9b::/96")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class EgressRefused(ToolError):
    """The policy refused a destination before any connection was made (not performed)."""


@dataclass(frozen=True)
class Route:
    """A checked destination: the name as written, the port, and the addresses (in the
    resolver's order) the connection may use."""

    scheme: str
    host: str
    port: int
    addresses: tuple[tuple[int, tuple], ...]  # (family, sockaddr) from the one resolution

    @property
    def allow_entry(self) -> str:
        return allow_entry(self.host, self.port)


def allow_entry(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def allowed_pairs() -> set[tuple[str, int]]:
    """ORCH_HTTP_ALLOW as (host, port) pairs; an entry without a port allows nothing."""
    pairs = set()
    for entry in settings.ORCH_HTTP_ALLOW:
        host, sep, port = entry.strip().rpartition(":")
        if not sep or not port.isdigit() or not host:
            continue
        pairs.add((_normal_host(host), int(port)))
    return pairs


def _normal_host(host: str) -> str:
    host = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    try:  # one spelling per address ("::FFFF:127.0.0.1" and "::ffff:7f00:1" alike)
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def why_forbidden(address: Address) -> str | None:
    """What makes `address` unreachable for an agent, in a person's words; None if public."""
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            reason = why_forbidden(embedded)
            return f"an IPv6 form of {embedded}, {reason}" if reason else None
    for test, reason in (
        ("is_unspecified", "the unspecified address"),
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_private", "a private address"),
        ("is_reserved", "a reserved address"),
    ):
        if getattr(address, test):
            return reason
    if address.version == 4 and address in SHARED_ADDRESS_SPACE:
        return "a shared (carrier-grade NAT) address"
    if not address.is_global:
        return "not a public address"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]  # the client's address (the server's is public by design)
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def parse(url: str) -> tuple[str, str, int]:
    """(scheme, host as written, port) of a URL the policy can judge, or EgressRefused."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise EgressRefused(f"http.request refused {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise EgressRefused(f"http.request refused {url!r}: only http and https URLs may be requested")
    if parts.username is not None or parts.password is not None:
        raise EgressRefused(f"http.request refused {url!r}: a URL may not carry a user name or password "
                            "(`user:password@`); send credentials in a header")
    if not parts.hostname:
        raise EgressRefused(f"http.request refused {url!r}: the URL names no host")
    return scheme, _normal_host(parts.hostname), port if port is not None else DEFAULT_PORTS[scheme]


def check(url: str) -> Route:
    """Resolve the URL's host once and judge every address; a Route to connect to, or
    EgressRefused naming what was refused and the ORCH_HTTP_ALLOW entry that would allow it."""
    scheme, host, port = parse(url)
    allowed = allowed_pairs()
    host_allowed = (host, port) in allowed

    def refuse(what: str) -> EgressRefused:
        return EgressRefused(
            f"http.request refused {url}: {what}. Agents may not reach loopback, private, link-local or "
            f"metadata addresses; an administrator can allow this destination with "
            f"ORCH_HTTP_ALLOW={allow_entry(host, port)}")

    if host in METADATA_NAMES and not host_allowed:
        raise refuse(f"{host} is a cloud metadata name")
    try:
        answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise EgressRefused(f"http.request could not resolve {host} ({url}): {exc}") from None
    addresses = []
    for family, _type, _proto, _name, sockaddr in answers:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        reason = why_forbidden(address)
        if reason and not host_allowed and (str(address), port) not in allowed:
            # One forbidden answer refuses the name: a name that mixes public and private
            # answers is how rebinding is tried, and picking among them would hide it.
            shown = host if str(address) == host else f"{host} resolves to {address}, which"
            raise refuse(f"{shown} is {reason}")
        if (family, sockaddr) not in addresses:
            addresses.append((family, sockaddr))
    if not addresses:
        raise EgressRefused(f"http.request could not resolve {host} ({url}) to an IP address")
    return Route(scheme=scheme, host=host, port=port, addresses=tuple(addresses))


def connect_pinned(route: Route, timeout: float | None, source_address=None) -> socket.socket:
    """A TCP connection to the first of the route's checked addresses that answers (as
    socket.create_connection does, without resolving the name again)."""
    error = None
    for family, sockaddr in route.addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if timeout is not None:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error


def pinned_connection(base: type, route: Route) -> type:
    """`base` (HTTPConnection or HTTPSConnection) connecting to the route's checked addresses:
    http.client opens its socket through `_create_connection` (an attribute it sets for this
    kind of substitution), and keeps `host` for the Host header, SNI and the certificate check."""

    class Pinned(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._create_connection = lambda address, timeout=None, source_address=None: connect_pinned(
                route, timeout, source_address)

    return Pinned
