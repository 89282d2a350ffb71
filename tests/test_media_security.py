"""Issue 4: images from strangers. An adversarial suite against the worker's image intake.

Every server here listens on loopback (127.0.0.1 or ::1) and is started by the tests. A guard
replaces socket.socket.connect for every test: it records each connect, lets loopback through,
routes a few *fake public* addresses (documented below) to 127.0.0.1 on the same port so that the
default policy (https, public addresses only) can be exercised end to end, and refuses anything
else without sending a packet. A fake DNS (socket.getaddrinfo) answers for the test names only.
So "the blocked server saw zero requests" is checked twice: by the server's own log and by the
guard's record of connect attempts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import http.server
import io
import ipaddress
import json
import os
import socket
import ssl
import struct
import threading
import time
import zlib

import pytest

import handler
import runpod_vlm.media as intake
from runpod_vlm.families.base import FamilyAdapter
from runpod_vlm.fetch import MAX_URL_CHARS
from runpod_vlm.media import MAX_PARALLEL_FETCHES
from runpod_vlm.settings import MediaPolicy, Settings, SettingsError
from runpod_vlm.vocabulary import Generation, GenerationParams, GenerationRequest, ImageSpec, RequestError, Turn
from tools.sample_images import b64, data_uri, encode, png

FAKE_PUBLIC = "93.184.215.14"  # "the internet": the guard routes it to 127.0.0.1, same port
FAKE_PUBLIC_2 = "198.41.0.4"
PARAM = "messages[0].content[1].image_url"
SECRET = "tok3n-s3cret"


def resolve_image(spec, param: str, policy: MediaPolicy | None = None):
    """One image through the worker's own intake (media.read_images), under the settings the
    environment gives at this moment, as a worker booted now would read them; `policy` replaces their media policy."""
    settings = Settings.from_env()
    if policy is not None:
        settings = dataclasses.replace(settings, media=policy)
    params = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)
    item = GenerationRequest("chat", [Turn("user", [ImageSpec(spec, param), "what is it?"])], params)
    intake.read_images(item, settings)
    return item.images[0]


_real_connect = socket.socket.connect
_real_getaddrinfo = socket.getaddrinfo


# ---- images -------------------------------------------------------------------------------------


def png_bomb(width: int, height: int) -> bytes:
    """A 1-bit greyscale PNG of all zeros: tiny on the wire, huge once decoded."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


GOOD_PNG = png((32, 24))


def assert_good(image, size=(32, 24), color=(200, 30, 40)):
    assert image.mode == "RGB" and image.size == size
    assert image.getpixel((size[0] // 2, size[1] // 2)) == color


def close(a, b, tolerance=12):
    return all(abs(x - y) <= tolerance for x, y in zip(a, b))


# ---- network guard, fake DNS, servers -----------------------------------------------------------


class Net:
    def __init__(self):
        self.dns: dict = {}  # name -> list of addresses, or a callable returning one
        self.dns_calls: list[str] = []
        self.connects: list[tuple[str, int]] = []
        self.routed = {FAKE_PUBLIC, FAKE_PUBLIC_2}

    def connected_to(self, host: str) -> bool:
        return any(h == host for h, _ in self.connects)


@pytest.fixture(autouse=True)
def net(monkeypatch):
    state = Net()

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else str(host)
        try:
            ipaddress.ip_address(name.split("%")[0])
            return _real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
        except ValueError:
            pass
        state.dns_calls.append(name)
        answers = state.dns.get(name)
        if callable(answers):
            answers = answers()
        if not answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown name (test DNS)")
        out = []
        for answer in answers:
            v6 = ipaddress.ip_address(answer).version == 6
            sockaddr = (answer, port, 0, 0) if v6 else (answer, port)
            out.append((socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM, 6, "", sockaddr))
        return out

    def connect(sock, address):
        host, port = address[0], address[1]
        state.connects.append((host, port))
        if host in state.routed:
            return _real_connect(sock, ("127.0.0.1", port))
        if ipaddress.ip_address(host.split("%")[0]).is_loopback:
            return _real_connect(sock, address)
        raise ConnectionRefusedError(f"test guard: never connect to {host}")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    for name in list(os.environ):
        if name.startswith("VLM_") or name.lower().endswith("_proxy") or name.startswith("SSL_CERT"):
            monkeypatch.delenv(name)
    return state


class Server:
    """A loopback HTTP(S) server: routes map a path to fn(request_handler); hits logs requests."""

    def __init__(self, host="127.0.0.1", tls: ssl.SSLContext | None = None):
        self.routes: dict = {}
        self.hits: list[tuple[str, dict]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                outer.hits.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                route = outer.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                    return
                try:
                    route(self)
                except (OSError, ssl.SSLError):
                    pass  # the client hung up: expected for refused bodies

            def log_message(self, *args):
                pass

        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class HTTPServer(http.server.ThreadingHTTPServer):
            address_family = family
            daemon_threads = True
            block_on_close = False

        self.httpd = HTTPServer((host, 0), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str | None = None, scheme: str = "http") -> str:
        host = host or (f"[{self.host}]" if ":" in self.host else self.host)
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def send(body: bytes, content_type="image/png", length: int | None = None):
    def route(request):
        request.send_response(200)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body) if length is None else length))
        request.end_headers()
        request.wfile.write(body)

    return route


def redirect(location: str, status: int = 302):
    def route(request):
        request.send_response(status)
        request.send_header("Location", location)
        request.send_header("Content-Length", "0")
        request.end_headers()

    return route


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(**kwargs) -> Server:
        server = Server(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A throwaway CA and a certificate for *.example.com, made with `cryptography`."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(text):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("test CA"))
        .issuer_name(name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(name("images.example.com"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("*.example.com"), x509.DNSName("example.com")]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("pki")
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "leaf.pem").write_bytes(
        leaf.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "leaf.pem")
    return str(folder / "ca.pem"), context


@pytest.fixture
def public(servers, net, pki, monkeypatch):
    """An https server on "the internet": images.example.com -> a fake public address -> loopback."""
    ca_file, context = pki
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    server = servers(tls=context)
    server.routes["/cat.png"] = send(GOOD_PNG)
    for host in ("images.example.com", "cdn.example.com", "example.com"):
        net.dns[host] = [FAKE_PUBLIC]
    server.https = lambda path, host="images.example.com": server.url(path, host, "https")
    return server


@pytest.fixture
def internal(servers):
    """A loopback service that a stranger must never reach; it answers with a (secret) image."""
    server = servers()
    server.routes["/secret.png"] = send(png((32, 24), (0, 0, 0)))
    server.routes["/latest/meta-data/"] = send(b"iam-credentials")
    return server


def refuse(spec, code, param=PARAM, **policy):
    with pytest.raises(RequestError) as caught:
        resolve_image(spec, param, MediaPolicy(**policy) if policy else None)
    error = caught.value
    assert error.code == code, (error.code, error.message)
    assert error.param == param
    return error


def assert_untouched(server: Server, net: Net):
    assert server.hits == []
    assert ("127.0.0.1", server.port) not in net.connects and ("::1", server.port) not in net.connects


def assert_clean(message: str):
    """Fixed text only: no query string, no library text, no heap address, no traceback."""
    for leak in (SECRET, "0x7f", "<_io", "Traceback", "cannot identify", "Errno", "PIL"):
        assert leak not in message, message


# ---- scheme and URL shape (validation layer: no request leaves) ---------------------------------


def test_default_policy_is_https_and_base64_only():
    policy = MediaPolicy.from_env({})
    assert not policy.allow_internal and not policy.allow_http and not policy.trust_env_proxy
    assert policy.max_image_bytes == 64 << 20 and policy.max_base64_bytes == 16 << 20
    assert policy.media_dir is None and policy.allowed_domains == ()


def test_plain_http_is_refused_by_default(internal, net):
    error = refuse(internal.url("/secret.png"), "blocked_url")
    assert "https" in error.message
    assert_untouched(internal, net)


@pytest.mark.parametrize(
    "spec", ["ftp://images.example.com/a.png", "gopher://127.0.0.1:70/_x", "javascript:alert(1)", "C:\\images\\a.png"]
)
def test_other_schemes_are_refused(spec, net):
    refuse(spec, "invalid_image_url")
    assert net.connects == [] and net.dns_calls == []


@pytest.mark.parametrize(
    "spelling",
    [
        "127.0.0.1",
        "2130706433",
        "0x7f.1",
        "127.1",
        "0177.0.0.1",
        "0x7f000001",
        "017700000001",
        "127.0.0.1.",
        "127.000.000.001",
        "0x7F.0.0.1",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[::1]",
        "[0:0:0:0:0:0:0:1]",
        "１２７．０．０．１",
        "localhost",
        "LOCALHOST.",
        "api.localhost",
    ],
)
def test_every_spelling_of_loopback_is_blocked_before_connect(spelling, internal, net):
    url = f"https://{spelling}:{internal.port}/secret.png?key={SECRET}"
    error = refuse(url, "blocked_url")
    assert_clean(error.message)
    assert_untouched(internal, net)
    assert net.connects == []


@pytest.mark.parametrize(
    "host",
    [
        "169.254.169.254",
        "[fd00:ec2::254]",
        "metadata.google.internal",
        "100.100.100.200",
        "[fe80::1]",
        "0.0.0.0",
        "0",
        "10.0.0.1",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "[fc00::1]",
        "[::]",
        "[2002:7f00:1::]",
        "[64:ff9b::a9fe:a9fe]",
        "[fec0::1]",
        "printer.local",
        "db.corp.internal",
        "metadata",
        "instance-data",
    ],
)
def test_metadata_private_and_reserved_hosts_are_blocked(host, net):
    refuse(f"https://{host}/latest/meta-data/", "blocked_url")
    assert net.connects == [] and net.dns_calls == []


@pytest.mark.parametrize(
    "url",
    [
        "https://images.example.com@169.254.169.254/",
        "https://user:pass@images.example.com/cat.png",
        "https://images.example.com%40169.254.169.254/",
    ],
)
def test_credentials_in_urls_are_refused(url, net):
    error = refuse(url, "blocked_url" if "@" in url else "invalid_image_url")
    assert net.connects == []
    assert "169.254" not in error.message and "pass" not in error.message


@pytest.mark.parametrize(
    "url",
    [
        "https://images.example.com\\@127.0.0.1/",
        "https://127.0.0.1\\.images.example.com/",
        "https://images.example.com/a b.png",
        "https://images.example.com/\x00.png",
        "https://images.\nexample.com/",
        "https://images.example.com/a\tb.png",
        "https://images.example.com\u200b/",
        "https://[::1/",
        "https://images.example.com:99999/",
        "https://images.example.com:0/",
        "https:///cat.png",
        "https://[fe80::1%25eth0]/",
        "https://1.2.3.4.5/",
        "https://example.123/",
        "https://" + "a" * 17000 + ".com/",
    ],
)
def test_malformed_urls_are_refused(url, net):
    refuse(url, "invalid_image_url")
    assert net.connects == []


def test_url_length_cap_is_16_kib(public, net):
    long_path = "/cat.png?pad=" + "x" * (MAX_URL_CHARS)
    refuse(public.https(long_path), "invalid_image_url")
    assert public.hits == [] and net.connects == []


def test_harmless_odd_numeric_spelling_is_refused_not_rewritten(net):
    error = refuse("https://0x5d.184.215.14/a.png", "invalid_image_url")
    assert "four decimal parts" in error.message and net.connects == []


# ---- the allowed path, through "the internet" ---------------------------------------------------


def test_https_fetch_pins_the_checked_address_and_keeps_the_name(public, net):
    image = resolve_image(public.https(f"/cat.png?sig={SECRET}"), PARAM)
    assert_good(image)
    path, headers = public.hits[0]
    assert path == f"/cat.png?sig={SECRET}"
    assert headers["host"] == f"images.example.com:{public.port}"  # certificate checked for the name
    assert net.connects == [(FAKE_PUBLIC, public.port)]


def test_certificate_for_another_name_fails_even_at_a_pinned_address(public, net):
    net.dns["images.example.org"] = [FAKE_PUBLIC]
    error = refuse(public.https("/cat.png", "images.example.org"), "fetch_failed")
    assert_clean(error.message)
    assert public.hits == []
    assert_good(resolve_image(public.https("/cat.png"), PARAM))


def test_any_blocked_dns_answer_refuses_the_url(public, net):
    net.dns["mixed.example.com"] = [FAKE_PUBLIC, "10.0.0.7"]
    refuse(public.https("/cat.png", "mixed.example.com"), "blocked_url")
    assert net.connects == [] and public.hits == []


def test_name_resolving_to_loopback_is_refused(public, internal, net):
    net.dns["sneaky.example.com"] = ["127.0.0.1"]
    refuse(f"https://sneaky.example.com:{internal.port}/secret.png", "blocked_url")
    assert_untouched(internal, net)
    assert_good(resolve_image(public.https("/cat.png"), PARAM))


def test_unresolvable_name_fails_cleanly(net):
    error = refuse("https://nowhere.example.net/a.png", "fetch_failed")
    assert "resolve" in error.message and net.connects == []


def test_dns_rebinding_connects_only_to_the_address_that_was_checked(public, internal, net):
    answers = iter([[FAKE_PUBLIC]])
    net.dns["rebind.example.com"] = lambda: next(answers, ["127.0.0.1"])
    image = resolve_image(public.https("/cat.png", "rebind.example.com"), PARAM)
    assert_good(image)
    assert net.dns_calls.count("rebind.example.com") == 1  # never resolved again at connect
    assert net.connects == [(FAKE_PUBLIC, public.port)]
    assert_untouched(internal, net)


def test_dns_rebinding_between_redirect_hops_is_caught(public, internal, net):
    answers = iter([[FAKE_PUBLIC]])
    net.dns["rebind.example.com"] = lambda: next(answers, ["127.0.0.1"])
    public.routes["/hop"] = redirect(public.https("/cat.png", "rebind.example.com"))
    error = refuse(public.https("/hop", "rebind.example.com"), "blocked_url")
    assert "redirect" in error.message
    assert len(public.hits) == 1 and not net.connected_to("127.0.0.1")


def test_redirect_chain_into_loopback_is_refused_before_connect(public, internal, net):
    public.routes["/a"] = redirect(public.https("/b", "cdn.example.com"))
    public.routes["/b"] = redirect(f"https://127.0.0.1:{internal.port}/secret.png")
    error = refuse(public.https("/a"), "blocked_url")
    assert "after a redirect" in error.message
    assert [p for p, _ in public.hits] == ["/a", "/b"]
    assert_untouched(internal, net)
    assert_good(resolve_image(public.https("/cat.png"), PARAM))


@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://169.254.169.254/latest/meta-data/",
        "https://[::ffff:169.254.169.254]/",
        "https://2852039166/",
        "https://metadata.google.internal/",
        "https://meta.example.com/latest/meta-data/",
    ],
)
def test_redirect_to_cloud_metadata_never_connects(location, public, net):
    net.dns["meta.example.com"] = ["169.254.169.254"]
    public.routes["/go"] = redirect(location, 307)
    refuse(public.https("/go"), "blocked_url")
    assert not net.connected_to("169.254.169.254") and net.connects == [(FAKE_PUBLIC, public.port)]


def test_https_to_http_downgrade_is_refused(public, net):
    public.routes["/down"] = redirect(f"http://cdn.example.com:{public.port}/cat.png", 301)
    error = refuse(public.https("/down"), "blocked_url")
    assert "http" in error.message and len(public.hits) == 1


def test_redirect_with_credentials_is_refused(public, net):
    public.routes["/cred"] = redirect(f"https://x@cdn.example.com:{public.port}/cat.png")
    refuse(public.https("/cred"), "blocked_url")
    assert len(public.hits) == 1


def test_three_redirects_are_followed_and_a_fourth_is_not(public):
    for n in range(4):
        public.routes[f"/r{n}"] = redirect(f"/r{n + 1}" if n < 3 else "/cat.png")
    public.routes["/r4"] = send(GOOD_PNG)
    assert_good(resolve_image(public.https("/r1"), PARAM))  # r1 -> r2 -> r3 -> cat: 3 hops
    error = refuse(public.https("/r0"), "fetch_failed")  # r0 -> r1 -> r2 -> r3 -> ...: 4 hops
    assert "more than 3" in error.message


def test_redirect_loop_ends(public):
    public.routes["/loop"] = redirect("/loop")
    refuse(public.https("/loop"), "fetch_failed")
    assert len(public.hits) == 4


def test_error_status_is_reported_without_the_url(public):
    error = refuse(public.https(f"/missing.png?token={SECRET}"), "fetch_failed")
    assert "404" in error.message
    assert_clean(error.message)
    assert "example.com" not in error.message


def test_allowed_domains_narrow_the_policy(public, net, monkeypatch):
    monkeypatch.setenv("VLM_URL_ALLOWED_DOMAINS", "example.com")
    assert_good(resolve_image(public.https("/cat.png"), PARAM))
    for host in ("notexample.com", "example.com.evil.net", "images.example.org"):
        net.dns[host] = [FAKE_PUBLIC]
        refuse(public.https("/cat.png", host), "blocked_url")
    refuse(f"https://{FAKE_PUBLIC}:{public.port}/cat.png", "blocked_url")
    assert len(public.hits) == 1


def test_environment_proxy_is_ignored_by_default(public, servers, monkeypatch):
    proxy = servers()
    monkeypatch.setenv("HTTPS_PROXY", proxy.url(""))
    monkeypatch.setenv("HTTP_PROXY", proxy.url(""))
    assert_good(resolve_image(public.https("/cat.png"), PARAM))
    assert proxy.hits == [] and len(public.hits) == 1


def test_trusted_environment_proxy_is_used(servers, net, monkeypatch):
    proxy = servers()
    proxy.routes["http://images.example.net/cat.png"] = send(GOOD_PNG)
    net.dns["images.example.net"] = [FAKE_PUBLIC]
    monkeypatch.setenv("VLM_TRUST_ENV_PROXY", "true")
    monkeypatch.setenv("VLM_ALLOW_INTERNAL_URLS", "true")
    monkeypatch.setenv("HTTP_PROXY", proxy.url(""))
    assert_good(resolve_image("http://images.example.net/cat.png", PARAM))
    assert proxy.hits[0][0] == "http://images.example.net/cat.png"
    assert net.connects == [("127.0.0.1", proxy.port)]


# ---- bytes and time: caps and the deadline (trusted loopback, VLM_ALLOW_INTERNAL_URLS) -----------


@pytest.fixture
def trusted(servers, monkeypatch):
    monkeypatch.setenv("VLM_ALLOW_INTERNAL_URLS", "true")
    server = servers()
    server.routes["/cat.png"] = send(GOOD_PNG)
    return server


def test_allow_internal_opens_http_and_loopback(trusted):
    assert_good(resolve_image(trusted.url("/cat.png"), PARAM))


def test_allow_internal_still_refuses_credentials(trusted):
    refuse(f"http://u:p@127.0.0.1:{trusted.port}/cat.png", "blocked_url")
    assert trusted.hits == []


def test_oversized_body_is_refused(trusted, monkeypatch):
    monkeypatch.setenv("VLM_MAX_IMAGE_BYTES", "100000")
    trusted.routes["/big.png"] = send(GOOD_PNG + b"\x00" * 200_000)
    error = refuse(trusted.url("/big.png"), "image_too_large")
    assert "100000 bytes" in error.message
    assert_good(resolve_image(trusted.url("/cat.png"), PARAM))


def test_endless_body_stops_at_the_cap(trusted, monkeypatch):
    monkeypatch.setenv("VLM_MAX_IMAGE_BYTES", str(1 << 20))
    sent = []

    def endless(request):
        request.send_response(200)
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        piece = b"\x00" * 65536
        for _ in range(1024):  # 64 MiB at most: the test stops by itself
            request.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent.append(len(piece))

    trusted.routes["/endless"] = endless
    refuse(trusted.url("/endless"), "image_too_large")
    assert sum(sent) < 64 << 20
    assert_good(resolve_image(trusted.url("/cat.png"), PARAM))


def test_declared_huge_length_is_refused_before_reading(trusted):
    trusted.routes["/huge"] = send(GOOD_PNG, length=10 << 30)
    refuse(trusted.url("/huge"), "image_too_large")


def test_lying_small_content_length_yields_a_clean_error(trusted):
    trusted.routes["/lie"] = send(GOOD_PNG + b"\x00" * 100_000, length=40)  # says 40 bytes, sends more
    error = refuse(trusted.url("/lie"), "invalid_image_format")
    assert_clean(error.message)
    assert_good(resolve_image(trusted.url("/cat.png"), PARAM))


def test_content_length_longer_than_the_body_fails(trusted):
    def short(request):
        request.send_response(200)
        request.send_header("Content-Length", str(len(GOOD_PNG) + 5000))
        request.send_header("Connection", "close")
        request.end_headers()
        request.wfile.write(GOOD_PNG)
        request.close_connection = True

    trusted.routes["/short"] = short
    refuse(trusted.url("/short"), "fetch_failed")


@pytest.mark.parametrize("phase", ["headers", "body", "silence"])
def test_slow_servers_hit_the_one_deadline(phase, trusted, monkeypatch):
    monkeypatch.setenv("VLM_FETCH_TIMEOUT", "1")

    def slow(request):
        stop = time.monotonic() + 6  # bounded: the server gives up by itself
        if phase == "silence":
            time.sleep(3)
            return
        if phase == "headers":
            request.wfile.write(b"HTTP/1.1 200 OK\r\n")
            while time.monotonic() < stop:
                request.wfile.write(b"X-Drip: a\r\n")
                request.wfile.flush()
                time.sleep(0.2)
            return
        request.send_response(200)
        request.send_header("Content-Length", "100000")
        request.end_headers()
        request.wfile.write(GOOD_PNG[:20])
        while time.monotonic() < stop:
            request.wfile.write(b"\x00")
            request.wfile.flush()
            time.sleep(0.2)

    trusted.routes["/slow"] = slow
    started = time.monotonic()
    refuse(trusted.url("/slow"), "fetch_timeout")
    assert time.monotonic() - started < 5  # one 1-second deadline, generously
    assert_good(resolve_image(trusted.url("/cat.png"), PARAM))


def test_svg_content_type_is_refused(trusted):
    trusted.routes["/logo"] = send(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")
    error = refuse(trusted.url("/logo"), "unsupported_image_format")
    assert "SVG" in error.message


def test_ipv6_loopback_server_is_blocked_then_allowed(servers, net, monkeypatch):
    try:
        server = servers(host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    server.routes["/cat.png"] = send(GOOD_PNG)
    refuse(server.url("/cat.png").replace("http:", "https:"), "blocked_url")
    assert server.hits == [] and net.connects == []
    monkeypatch.setenv("VLM_ALLOW_INTERNAL_URLS", "true")
    assert_good(resolve_image(server.url("/cat.png"), PARAM))


# ---- base64 and data URIs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "not base64 at all!",
        "%%%",
        "iVBORw0KGgo=====",
        "iVBORw0K+GgoAAAA_AAA",
        "A",
        "data:image/png;base64,***",
        "data:image/png;base64,",
        "====",
    ],
)
def test_invalid_base64_is_refused(spec):
    error = refuse(spec, "invalid_base64")
    assert "base64" in error.message


def test_base64_variants_that_are_accepted():
    raw = b64(GOOD_PNG)
    wrapped = "\n".join(raw[i : i + 76] for i in range(0, len(raw), 76))
    urlsafe = base64.urlsafe_b64encode(GOOD_PNG).decode().rstrip("=")
    for spec in (
        raw,
        wrapped,
        urlsafe,
        data_uri(GOOD_PNG),
        "DATA:image/png;BASE64," + raw,
        {"url": data_uri(GOOD_PNG)},
    ):
        assert_good(resolve_image(spec, PARAM))


def test_non_base64_data_uri_is_refused():
    error = refuse("data:image/png,%89PNG", "invalid_image_url")
    assert "base64" in error.message


def test_huge_data_uri_is_refused_before_decoding(monkeypatch):
    monkeypatch.setenv("VLM_MAX_BASE64_BYTES", str(1 << 20))

    def no_decode(*args, **kwargs):
        raise AssertionError("decoded an oversized payload")

    monkeypatch.setattr(intake.base64, "b64decode", no_decode)
    error = refuse("data:image/png;base64," + "A" * ((1 << 20) + 4), "image_too_large")
    assert "1 MiB" in error.message
    refuse("A" * ((1 << 20) + 4), "image_too_large")


def test_default_base64_cap_is_16_mib():
    refuse("data:image/png;base64," + "A" * ((16 << 20) + 4), "image_too_large")


# ---- decoding -----------------------------------------------------------------------------------


def test_decompression_bomb_png_is_refused_from_its_header():
    bomb = png_bomb(20_000, 20_000)  # 400 megapixels
    assert len(bomb) < 200_000
    started = time.monotonic()
    refuse(data_uri(bomb), "image_too_large")
    assert time.monotonic() - started < 5


def test_pixel_cap_is_ours_not_pillows(monkeypatch):
    bomb = png_bomb(7_000, 7_000)  # 49 MP: under Pillow's limit, over the default 40 MP
    error = refuse(data_uri(bomb), "image_too_large")
    assert "7000x7000" in error.message
    monkeypatch.setenv("VLM_MAX_IMAGE_PIXELS", "1000")
    refuse(data_uri(png(size=(40, 40))), "image_too_large")


def test_truncated_jpeg_is_refused():
    from PIL import Image

    jpeg = encode(Image.effect_noise((128, 128), 60).convert("RGB"), "JPEG", quality=90)
    error = refuse(b64(jpeg[: len(jpeg) // 2]), "invalid_image_format")
    assert "truncated or corrupt" in error.message


def test_garbage_bytes_never_leak_pillow_text():
    error = refuse(b64(os.urandom(2048)), "invalid_image_format")
    assert_clean(error.message)
    assert "JPEG, PNG, WEBP, GIF, BMP or TIFF" in error.message


@pytest.mark.parametrize(
    "svg",
    [
        b"<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'/>",
        b"\xef\xbb\xbf<?xml version='1.0'?>\n<svg xmlns='http://www.w3.org/2000/svg'/>",
    ],
)
def test_svg_is_detected_and_refused(svg):
    for spec in (data_uri(svg, "image/png"), b64(svg), data_uri(svg, "image/svg+xml")):
        error = refuse(spec, "unsupported_image_format")
        assert "SVG" in error.message


@pytest.mark.parametrize("fmt", ["ICO", "PSD-magic", "PDF-magic"])
def test_formats_outside_the_allow_list_are_refused(fmt):
    from PIL import Image

    data = {
        "ICO": lambda: encode(Image.new("RGB", (32, 32), "red"), "ICO"),
        "PSD-magic": lambda: b"8BPS\x00\x01" + b"\x00" * 40,
        "PDF-magic": lambda: b"%PDF-1.7\n" + b"\x00" * 40,
    }[fmt]()
    refuse(b64(data), "unsupported_image_format")


@pytest.mark.parametrize("size", [(1, 1), (7, 100), (100, 7)])
def test_tiny_images_are_refused(size):
    error = refuse(b64(png(size=size)), "image_too_small")
    assert f"{size[0]}x{size[1]}" in error.message and "at least 8" in error.message


def test_minimum_side_is_settable(monkeypatch):
    assert_good(resolve_image(b64(png(size=(8, 8))), PARAM), size=(8, 8))
    monkeypatch.setenv("VLM_MIN_IMAGE_SIDE", "16")
    refuse(b64(png(size=(8, 8))), "image_too_small")


def test_fifty_frame_gif_gives_frame_zero():
    from PIL import Image

    frames = [Image.new("RGB", (40, 30), (255, 0, 0) if i == 0 else (0, i * 5, 255)) for i in range(50)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=20, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 50
    image = resolve_image(b64(data), PARAM)
    assert image.mode == "RGB" and image.size == (40, 30)
    assert image.getpixel((20, 15)) == (255, 0, 0)


def test_animated_webp_gives_frame_zero():
    from PIL import Image

    frames = [Image.new("RGB", (24, 24), c) for c in ((0, 255, 0), (255, 0, 255), (0, 0, 0))]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    image = resolve_image(b64(data), PARAM)
    assert image.getpixel((12, 12)) == (0, 255, 0)


def test_exif_rotated_photo_is_turned_upright():
    from PIL import Image

    photo = Image.new("RGB", (60, 30), (255, 0, 0))
    photo.paste((0, 0, 255), (30, 0, 60, 30))  # stored: red left, blue right
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = resolve_image(b64(encode(photo, "JPEG", exif=exif, quality=95)), PARAM)
    assert image.size == (30, 60)
    assert close(image.getpixel((15, 5)), (255, 0, 0)) and close(image.getpixel((15, 55)), (0, 0, 255))


def test_cmyk_jpeg_becomes_rgb():
    from PIL import Image

    data = encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95)
    image = resolve_image(b64(data), PARAM)
    assert image.mode == "RGB" and close(image.getpixel((8, 8)), (255, 0, 0))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_sixteen_bit_grey_is_scaled_not_clipped(fmt):
    from PIL import Image

    data = encode(Image.new("I;16", (16, 16), 32768), fmt)
    image = resolve_image(b64(data), PARAM)
    assert image.mode == "RGB" and close(image.getpixel((3, 3)), (128, 128, 128), 1)


def test_float_and_bilevel_modes_become_rgb():
    from PIL import Image

    floats = resolve_image(b64(encode(Image.new("F", (16, 16), 0.5), "TIFF")), PARAM)
    assert close(floats.getpixel((1, 1)), (127, 127, 127), 1)
    bilevel = resolve_image(b64(encode(Image.new("1", (16, 16), 1), "BMP")), PARAM)
    assert bilevel.getpixel((1, 1)) == (255, 255, 255)


@pytest.mark.parametrize("mode,color", [("RGBA", (255, 0, 0, 0)), ("LA", (0, 0)), ("P", None)])
def test_transparency_is_composited_on_white(mode, color):
    from PIL import Image

    if mode == "P":
        picture = Image.new("P", (16, 16), 3)
        picture.putpalette([0, 0, 0] * 256)
        data = encode(picture, "PNG", transparency=3)
    else:
        data = encode(Image.new(mode, (16, 16), color), "PNG")
    image = resolve_image(b64(data), PARAM)
    assert image.mode == "RGB" and image.getpixel((5, 5)) == (255, 255, 255)


def test_half_transparent_red_blends_with_white():
    from PIL import Image

    image = resolve_image(b64(encode(Image.new("RGBA", (16, 16), (255, 0, 0, 128)), "PNG")), PARAM)
    assert close(image.getpixel((5, 5)), (255, 127, 127), 2)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_every_allowed_format_decodes(fmt):
    from PIL import Image

    data = encode(Image.new("RGB", (20, 10), (0, 128, 255)), fmt)
    image = resolve_image(b64(data), PARAM)
    assert image.size == (20, 10) and close(image.getpixel((10, 5)), (0, 128, 255), 20)


# ---- local files --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", ["/etc/passwd", "file:///etc/passwd", "cat.png", "./cat.png", "file://localhost/srv/cat.png"]
)
def test_local_files_are_off_by_default(spec):
    error = refuse(spec, "blocked_url")
    assert "local files are disabled" in error.message


@pytest.fixture
def media(tmp_path, monkeypatch):
    folder = tmp_path / "media"
    (folder / "sub").mkdir(parents=True)
    (folder / "cat.png").write_bytes(GOOD_PNG)
    (folder / "sub" / "dog.png").write_bytes(GOOD_PNG)
    (tmp_path / "outside.png").write_bytes(GOOD_PNG)
    (folder / "escape.png").symlink_to(tmp_path / "outside.png")
    (folder / "inside-link.png").symlink_to(folder / "cat.png")
    monkeypatch.setenv("VLM_MEDIA_DIR", str(folder))
    return folder


def test_media_dir_serves_files_inside_it(media):
    for spec in ("cat.png", "sub/dog.png", str(media / "cat.png"), f"file://{media}/sub/dog.png", "inside-link.png"):
        assert_good(resolve_image(spec, PARAM))


@pytest.mark.parametrize(
    "spec",
    [
        "../outside.png",
        "sub/../../outside.png",
        "escape.png",
        "/etc/passwd",
        "file:///etc/passwd",
        "file://otherhost/cat.png",
    ],
)
def test_media_dir_escapes_are_refused(spec, media):
    error = refuse(spec, "invalid_image_url" if "otherhost" in spec else "blocked_url")
    assert str(media) not in error.message


def test_media_dir_refuses_fifos_and_missing_files(media):
    os.mkfifo(media / "pipe.png")
    started = time.monotonic()
    refuse("pipe.png", "fetch_failed")
    assert time.monotonic() - started < 5
    refuse("nope.png", "fetch_failed")


# ---- end to end: the worker answers and keeps serving -------------------------------------------


@pytest.fixture
def worker(monkeypatch):
    """The real handler with no model: a stand-in engine whose answer counts the images."""

    class FakeEngine:
        """Its settings are a worker's booted with the test's environment as it is at each job (fixtures set it)."""

        pinned = None  # settings a test fixes instead
        model_id = "test/fake-vlm"
        quantize = "none"
        adapter = FamilyAdapter()

        @property
        def settings(self):
            return self.pinned or Settings.from_env()

    def generate_all(engine, items, cancelled=None):
        return [
            Generation(text=" ".join(f"{i.width}x{i.height}" for i in item.images), finish_reason="stop")
            for item in items
        ]

    monkeypatch.setattr(handler, "_engine", FakeEngine())

    async def generate_one(engine, item):
        return generate_all(engine, [item])[0]

    monkeypatch.setattr(handler, "generate_all", generate_all)
    monkeypatch.setattr(handler, "generate_one", generate_one)
    return lambda job: asyncio.run(handler.local_test_answer(job))


def chat(*blocks) -> dict:
    return {"input": {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, *blocks]}]}}


def test_worker_answers_a_blocked_url_and_keeps_serving(worker, internal, net):
    answer = worker(chat({"type": "image_url", "image_url": {"url": f"https://127.0.0.1:{internal.port}/secret.png"}}))
    assert answer["code"] == "blocked_url" and answer["param"] == "messages[0].content[1].image_url.url"
    assert json.loads(answer["error"])["error_message"].startswith("messages[0].content[1].image_url.url: ")
    assert_untouched(internal, net)
    good = worker(chat({"type": "image_url", "image_url": {"url": data_uri(GOOD_PNG)}}))
    assert good["response"] == "32x24" and good["image_count"] == 1


def test_worker_reports_the_field_of_a_bad_loose_image(worker):
    answer = worker({"input": {"task": "caption", "image_b64": "%%%"}})
    assert set(answer) == {"error", "code", "param"}
    assert answer["code"] == "invalid_base64" and answer["param"] == "image_b64"
    answer = worker({"input": {"task": "caption", "images": [b64(GOOD_PNG), b64(png(size=(1, 1)))]}})
    assert answer["code"] == "image_too_small" and answer["param"] == "images[1]"
    assert worker({"input": {"task": "caption", "image_b64": b64(GOOD_PNG)}})["response"] == "32x24"


def test_worker_refuses_svg_and_garbage_with_fixed_messages(worker):
    svg = worker(chat({"type": "image_url", "image_url": data_uri(b"<svg/>", "image/svg+xml")}))
    assert svg["code"] == "unsupported_image_format" and svg["param"] == PARAM
    junk = worker(chat({"type": "image", "image": b64(os.urandom(512))}))
    assert junk["code"] == "invalid_image_format" and junk["param"] == "messages[0].content[1].image"
    assert_clean(junk["error"])


def test_too_many_images_are_refused_before_any_fetch(worker, trusted):
    urls = [trusted.url("/cat.png")] * 17
    answer = worker({"input": {"task": "caption", "images": urls}})
    assert answer["code"] == "too_many_images" and trusted.hits == []
    assert worker({"input": {"task": "caption", "images": urls[:2]}})["response"] == "32x24 32x24"


def test_batch_keeps_good_items_beside_blocked_ones(worker, internal, net):
    answer = worker(
        {
            "id": "job-1",
            "input": {
                "requests": [
                    {"task": "caption", "image_url": f"https://169.254.169.254:{internal.port}/latest/meta-data/"},
                    {"task": "caption", "image_url": data_uri(GOOD_PNG)},
                ]
            },
        }
    )
    first, second = answer["results"]
    assert first["code"] == "blocked_url" and first["param"] == "requests[0].image_url"
    assert second["response"] == "32x24"
    assert_untouched(internal, net) and not net.connected_to("169.254.169.254")


def test_worker_reports_a_misconfigured_media_setting(worker, monkeypatch):
    monkeypatch.setattr(handler, "_engine", None)  # a worker loading on its first job reads its settings then
    monkeypatch.setattr(handler, "get_engine", lambda quantize=None: pytest.fail("loaded with broken settings"))
    monkeypatch.setenv("VLM_FETCH_TIMEOUT", "soon")
    answer = worker({"input": {"task": "caption", "image_b64": b64(GOOD_PNG)}})
    assert answer["code"] == "worker_misconfigured" and "VLM_FETCH_TIMEOUT" in answer["error"]
    with pytest.raises(SettingsError, match="VLM_FETCH_TIMEOUT"):  # main() at boot
        Settings.from_env()


def test_lab_tiff_is_colour_managed_to_rgb():
    from PIL import Image

    data = encode(Image.new("LAB", (16, 16), (255, 128, 128)), "TIFF")  # L*=100, a=b=0: white
    image = resolve_image(b64(data), PARAM)
    assert image.mode == "RGB" and close(image.getpixel((4, 4)), (255, 255, 255), 3)


def test_image_count_spans_loose_images_and_message_blocks_before_any_fetch(worker, trusted):
    block = {"type": "image_url", "image_url": {"url": trusted.url("/cat.png")}}
    request = chat(*[block] * 10)
    request["input"]["images"] = [trusted.url("/cat.png")] * 7
    answer = worker(request)
    assert answer["code"] == "too_many_images" and trusted.hits == []
    assert answer["param"] == "messages[0].content[10].image_url"
    assert worker(chat(block))["response"] == "32x24"


def test_request_pixel_budget_refuses_from_the_header_before_decoding(worker, monkeypatch):
    monkeypatch.setattr(handler._engine, "pinned", Settings(max_total_pixels=32 * 24 * 2 + 10))
    decoded = []
    real_load = intake.decode_image

    def counting_decode(*args, **kwargs):
        image = real_load(*args, **kwargs)
        decoded.append(image.size)
        return image

    monkeypatch.setattr(intake, "decode_image", counting_decode)
    three = [b64(png((32, 24), (200, 30, n))) for n in range(3)]  # other bytes each: none recalled, all decoded
    intake.decoded_images.cache_clear()
    answer = worker({"input": {"task": "caption", "images": three}})
    assert answer["code"] == "image_too_large" and answer["param"] == "images[2]"
    assert "together" in answer["error"] and str(32 * 24 * 2 + 10) in answer["error"]
    assert len(decoded) == 2  # the third never came out of the decoder
    assert worker({"input": {"task": "caption", "images": [b64(GOOD_PNG)] * 2}})["response"] == "32x24 32x24"


# ---- one request, many images: side by side, under one deadline (VLM_FETCH_DEADLINE) ------------


@contextlib.contextmanager
def in_flight(state: dict):
    """Count, while inside, one more request waiting on its answer; `state["most"]`: the most at once."""
    lock = state.setdefault("lock", threading.Lock())
    with lock:
        state["now"] = state.get("now", 0) + 1
        state["most"] = max(state.get("most", 0), state["now"])
    try:
        yield
    finally:
        with lock:
            state["now"] -= 1


def test_default_fetch_deadline_is_30_seconds():
    assert MediaPolicy.from_env({}).fetch_deadline == 30.0
    assert MediaPolicy.from_env({"VLM_FETCH_DEADLINE": "2.5"}).fetch_deadline == 2.5


def test_images_of_one_request_download_side_by_side_in_order(worker, trusted):
    state: dict = {}
    for n in range(16):
        body = png(size=(16 + n, 16))

        def slow(request, body=body):
            with in_flight(state):  # the wait alone: once the body is sent, the worker may fetch the next
                time.sleep(0.3)
            send(body)(request)

        trusted.routes[f"/{n}.png"] = slow
    answer = worker({"input": {"task": "caption", "images": [trusted.url(f"/{n}.png") for n in range(16)]}})
    assert answer["response"] == " ".join(f"{16 + n}x16" for n in range(16))  # every image, in order
    assert 1 < state["most"] <= MAX_PARALLEL_FETCHES


def test_sixteen_stalled_images_take_one_deadline_not_sixteen(worker, trusted, monkeypatch):
    monkeypatch.setenv("VLM_FETCH_DEADLINE", "1")  # VLM_FETCH_TIMEOUT stays 20 s: the request's deadline wins

    def stalled(request):
        time.sleep(3)  # bounded: the server gives up by itself

    trusted.routes["/stalled.png"] = stalled
    started = time.monotonic()
    answer = worker({"input": {"task": "caption", "images": [trusted.url("/stalled.png")] * 16}})
    took = time.monotonic() - started
    assert answer["code"] == "fetch_timeout" and answer["param"] == "images[0]"
    assert "the request's images took over 1s" in answer["error"]
    assert took < 6  # one 1-second deadline, generously; one after another would be 16
    assert worker({"input": {"task": "caption", "images": [trusted.url("/cat.png")] * 2}})["response"] == "32x24 32x24"


def test_the_first_failing_image_in_order_is_named(worker, trusted):
    def late_missing(request):
        time.sleep(0.3)
        request.send_error(404)

    trusted.routes["/late-missing.png"] = late_missing
    images = [trusted.url("/cat.png"), trusted.url("/late-missing.png"), trusted.url("/nope.png")]
    answer = worker({"input": {"task": "caption", "images": images}})
    assert answer["code"] == "fetch_failed" and answer["param"] == "images[1]"


def test_a_stalled_image_in_a_message_names_its_block(worker, trusted, monkeypatch):
    monkeypatch.setenv("VLM_FETCH_DEADLINE", "1")
    trusted.routes["/stalled.png"] = lambda request: time.sleep(3)
    answer = worker(
        chat(
            {"type": "image_url", "image_url": {"url": trusted.url("/cat.png")}},
            {"type": "image_url", "image_url": {"url": trusted.url("/stalled.png")}},
        )
    )
    assert answer["code"] == "fetch_timeout" and answer["param"] == "messages[0].content[2].image_url.url"


def test_worker_reports_a_misconfigured_fetch_deadline(worker, monkeypatch):
    monkeypatch.setenv("VLM_FETCH_DEADLINE", "0")
    answer = worker({"input": {"task": "caption", "image_b64": b64(GOOD_PNG)}})
    assert answer["code"] == "worker_misconfigured" and "VLM_FETCH_DEADLINE" in answer["error"]


def test_names_whose_dns_stalls_do_not_hold_up_other_lookups(public, net, monkeypatch):
    monkeypatch.setenv("VLM_FETCH_TIMEOUT", "2")
    release = threading.Event()

    def stall():
        release.wait(5)  # bounded: the test releases it at the end
        return [FAKE_PUBLIC]

    for n in range(8):
        net.dns[f"stall{n}.example.com"] = stall

    def fetch(url):
        try:
            resolve_image(url, PARAM)
        except RequestError:
            pass  # these may time out or succeed once released: only the other lookup matters

    stalled = [
        threading.Thread(target=fetch, args=(public.https("/cat.png", f"stall{n}.example.com"),)) for n in range(8)
    ]
    for thread in stalled:
        thread.start()
    try:
        time.sleep(0.3)  # the eight lookups are under way
        assert_good(resolve_image(public.https("/cat.png"), PARAM))  # its own lookup is not queued behind them
    finally:
        release.set()
        for thread in stalled:
            thread.join()
