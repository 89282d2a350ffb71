"""The SSRF boundary: an image (or video) URL checked, resolved, pinned and fetched under byte caps and one deadline."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from runpod_vlm.settings import MediaPolicy, SettingsError
from runpod_vlm.vocabulary import RequestError

log = logging.getLogger("runpod-vlm")

# Images come from strangers (SSRF, bombs, broken files). Policy, after NVIDIA Dynamo's (README
# "Security"): https and base64/data URIs only; no internal addresses; pinned DNS; redirects re-checked
# by hand; one deadline; byte and pixel caps; fixed error messages that echo nothing.

MAX_URL_CHARS = 16 * 1024
MAX_REDIRECTS = 3
_BLOCKED_NAMES = ("localhost", "localhost.localdomain", "metadata.google.internal")
_BLOCKED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa")
URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_HOST_LABELS = re.compile(r"[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?)*")
_NUMERIC_LAST_LABEL = re.compile(r"(.*\.)?([0-9]+|0x[0-9a-f]*)")  # WHATWG: such a host is an IPv4 address
_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:@]+)(?::(\d{1,5}))?")


def size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


@dataclasses.dataclass(frozen=True)
class ImageURL:
    """A checked, normalised URL: what was validated is exactly what gets fetched."""

    scheme: str
    host: str  # ASCII, lower case, no trailing dot; an IP literal without brackets
    port: int
    target: str  # path and query, percent-encoded, sent as the request target
    ip: Any = None  # ipaddress object when the host is an IP literal

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return f"{self.scheme}://{host}{'' if self.port == default else f':{self.port}'}{self.target}"


def ip_is_blocked(ip) -> bool:
    """True for every address a stranger must not make the worker reach (policy's ranges)."""
    if ip.version == 6:  # is_global misses these; 6to4/Teredo carry an IPv4 inside
        embedded = [ip.sixtofour, *(ip.teredo or ())]
        if ip.ipv4_mapped is not None or ip.is_site_local or any(e is not None and ip_is_blocked(e) for e in embedded):
            return True
    return not ip.is_global or ip.is_multicast or ip.is_reserved  # is_global: private, CGNAT, loopback...


def check_image_url(
    url: str, policy: MediaPolicy, param: str, redirected: bool = False, kind: str = "image"
) -> ImageURL:
    """Validate and normalise one image (or video: `kind`) URL without touching the network (DNS comes later)."""
    import ipaddress
    import socket
    import unicodedata
    import urllib.parse

    def refuse(code: str, message: str):
        raise RequestError(code, message + (" (after a redirect)" if redirected else ""), param)

    if len(url) > MAX_URL_CHARS:
        refuse(f"invalid_{kind}_url", f"the {kind} URL is over {MAX_URL_CHARS} characters")
    if "\\" in url or any(unicodedata.category(c)[0] in "CZ" for c in url):
        refuse(f"invalid_{kind}_url", f"the {kind} URL holds a backslash, whitespace or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        refuse(f"invalid_{kind}_url", f"the {kind} URL could not be parsed")
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        refuse(f"invalid_{kind}_url", f"the {kind} URL must use https")
    if scheme == "http" and not (policy.allow_http or policy.allow_internal):
        refuse("blocked_url", f"plain http {kind} URLs are not allowed; use https")
    if "@" in parts.netloc:
        refuse("blocked_url", f"the {kind} URL may not carry credentials (user@host)")
    authority = _AUTHORITY.fullmatch(parts.netloc)
    if not authority:
        refuse(f"invalid_{kind}_url", f"the {kind} URL has no valid host")
    raw_host, raw_port = authority.groups()
    port = int(raw_port) if raw_port else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        refuse(f"invalid_{kind}_url", f"the {kind} URL has an invalid port")
    ip = None
    if raw_host.startswith("["):
        try:
            ip = ipaddress.IPv6Address(raw_host[1:-1])
        except ValueError:
            refuse(f"invalid_{kind}_url", f"the {kind} URL has an invalid IPv6 address")
        host = str(ip)
    else:
        try:
            host = raw_host.lower() if raw_host.isascii() else raw_host.encode("idna").decode("ascii").lower()
        except UnicodeError:
            refuse(f"invalid_{kind}_url", f"the {kind} URL has an invalid host name")
        host = host[:-1] if host.endswith(".") and not host.endswith("..") else host
        if _NUMERIC_LAST_LABEL.fullmatch(host):
            try:  # inet_aton parses what browsers do (127.1, 0x7f.1, 0177.0.0.1, 2130706433)
                ip = ipaddress.IPv4Address(socket.inet_aton(host))
            except OSError:
                refuse(f"invalid_{kind}_url", f"the {kind} URL has an invalid numeric host")
        elif not _HOST_LABELS.fullmatch(host) or len(host) > 253:
            refuse(f"invalid_{kind}_url", f"the {kind} URL has an invalid host name")
    if ip is not None and not policy.allow_internal and ip_is_blocked(ip):
        refuse("blocked_url", f"the {kind} URL points at an internal or reserved address")
    if ip is not None and host != str(ip):  # a blocked address is refused as such first, above
        refuse(f"invalid_{kind}_url", "write a numeric host as four decimal parts (a.b.c.d)")
    if ip is None and not policy.allow_internal:
        if host in _BLOCKED_NAMES or host.endswith(_BLOCKED_SUFFIXES) or "." not in host:
            refuse("blocked_url", f"the {kind} URL names an internal host")
    if policy.allowed_domains and not any(
        host == d or (ip is None and host.endswith("." + d)) for d in policy.allowed_domains
    ):
        refuse("blocked_url", f"the {kind} URL's host is not on this worker's allow-list")
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return ImageURL(scheme, host, port, path + (f"?{query}" if parts.query else ""), ip)


def checked_addresses(
    target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str, kind: str = "image"
) -> list:
    """Every DNS answer, each checked: one blocked answer refuses the URL (no racing A/AAAA)."""
    import concurrent.futures
    import ipaddress
    import socket

    if target.ip is not None:
        return [target.ip]
    future = _DNS_POOL.submit(socket.getaddrinfo, target.host, target.port, 0, socket.SOCK_STREAM)
    try:  # getaddrinfo has no timeout of its own: wait on it from here, under the fetch's deadline
        answers = future.result(timeout=max(deadline - time.monotonic(), 0.001))
    except concurrent.futures.TimeoutError:
        raise RequestError("fetch_timeout", f"the {kind} URL's host did not resolve in time" + after, param) from None
    except (OSError, UnicodeError):
        answers = []
    inet = (socket.AF_INET, socket.AF_INET6)
    addresses = list(dict.fromkeys(ipaddress.ip_address(a[4][0].split("%")[0]) for a in answers if a[0] in inet))
    if not policy.allow_internal and any(ip_is_blocked(ip) for ip in addresses):
        log.warning("%s fetch refused: the host of %s resolves to a blocked address", kind, param)
        raise RequestError("blocked_url", f"the {kind} URL's host resolves to an internal address" + after, param)
    if not addresses:
        raise RequestError("fetch_failed", f"the {kind} URL's host could not be resolved" + after, param)
    return addresses


# Shared by all jobs (threads start as needed): wide enough that names whose DNS stalls hold up no other.
_DNS_POOL = ThreadPoolExecutor(32, thread_name_prefix="vlm-dns")


def _tls_context():
    """The CAs of SSL_CERT_FILE / SSL_CERT_DIR when either is set, else certifi's bundle (as requests does)."""
    return _tls_context_for(os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)


@functools.lru_cache(maxsize=4)  # loading a CA bundle takes tens of milliseconds
def _tls_context_for(cafile: Optional[str], cadir: Optional[str]):
    import ssl

    if cafile is None and not cadir:
        with contextlib.suppress(ImportError):
            import certifi

            cafile = certifi.where()
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _pinned_connection(target: ImageURL, addresses: list, deadline: float):
    """An http.client connection to the checked addresses, never to a fresh DNS answer (DNS
    rebinding); the Host header, SNI and certificate check keep the name."""
    import http.client
    import socket

    def pin():
        last: Optional[OSError] = None
        for ip in addresses:  # each already checked by checked_addresses or check_image_url
            if (remaining := deadline - time.monotonic()) <= 0:
                raise TimeoutError
            try:
                return socket.create_connection((str(ip), target.port), timeout=remaining)
            except OSError as error:
                last = error
        raise last or OSError("no address")

    if target.scheme == "http":  # connect is pin(), under the deadline: no timeout of http.client's own
        conn = http.client.HTTPConnection(target.host, target.port)
        conn.connect = lambda: setattr(conn, "sock", pin())
        return conn
    tls = _tls_context()
    conn = http.client.HTTPSConnection(target.host, target.port, context=tls)
    conn.connect = lambda: setattr(conn, "sock", tls.wrap_socket(pin(), server_hostname=target.host))
    return conn


def _proxy_connection(target: ImageURL, policy: MediaPolicy, deadline: float):
    """(connection, request target, headers) through the environment's proxy when trusted, else None."""
    import http.client
    import urllib.parse
    import urllib.request

    if not policy.trust_env_proxy:
        return None
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(target.scheme)
    if not proxy or urllib.request.proxy_bypass_environment(target.host, proxies):
        return None
    parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if parts.scheme != "http" or not parts.hostname:
        raise SettingsError("the environment's proxy must be an http:// URL")
    headers = {}
    if parts.username is not None:
        credentials = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    timeout = max(deadline - time.monotonic(), 0.001)
    if target.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 8080, timeout=timeout, context=_tls_context())
        conn.set_tunnel(target.host, target.port, headers=headers)
        return conn, target.target, {}
    return http.client.HTTPConnection(parts.hostname, parts.port or 8080, timeout=timeout), target.url, headers


def fetch_image_url(
    url: str, policy: MediaPolicy, param: str, request_deadline: Optional[float] = None, kind: str = "image"
) -> bytes:
    """GET an image (or a video: `kind`): each hop checked, pinned and capped, under one deadline (the fetch's or
    the request's)."""
    import urllib.parse

    deadline = time.monotonic() + policy.fetch_timeout
    late = f"the {kind} URL took over {policy.fetch_timeout:g}s"
    if request_deadline is not None and request_deadline < deadline:
        deadline, late = request_deadline, f"the request's {kind}s took over {policy.fetch_deadline:g}s to download"
    target = check_image_url(url, policy, param, kind=kind)
    for hop in range(MAX_REDIRECTS + 1):
        after = " (after a redirect)" if hop else ""
        body_or_location = _fetch_once(target, policy, deadline, param, after, late, kind)
        if isinstance(body_or_location, bytes):
            return body_or_location
        if hop < MAX_REDIRECTS:
            location = urllib.parse.urljoin(target.url, body_or_location)
            target = check_image_url(location, policy, param, redirected=True, kind=kind)
    raise RequestError("fetch_failed", f"the {kind} URL redirected more than {MAX_REDIRECTS} times", param)


def _fetch_once(target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str, late: str, kind: str):
    """One request: the body (bytes) or a redirect's Location (str). `late` says which deadline passed."""
    import http.client
    import socket

    via_proxy = _proxy_connection(target, policy, deadline)
    addresses = checked_addresses(target, policy, deadline, param, after, kind)
    conn, request_target, headers = via_proxy or (_pinned_connection(target, addresses, deadline), target.target, {})
    headers.update({"User-Agent": f"runpod-vlm {kind} fetch", "Accept": f"{kind}/*", "Accept-Encoding": "identity"})
    expired = threading.Event()

    def abort():  # the deadline covers slow headers too (a per-read timeout never fires on a drip)
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", request_target, headers=headers)
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            if not location:
                raise RequestError("fetch_failed", f"the {kind} URL redirected without a Location" + after, param)
            return location.strip()
        if response.status != 200:
            raise RequestError("fetch_failed", f"the {kind} URL answered HTTP {response.status}" + after, param)
        if kind == "image" and response.headers.get_content_type() == "image/svg+xml":
            raise RequestError("unsupported_image_format", SVG_MESSAGE, param)
        declared = response.length  # the Content-Length, parsed by http.client
        too_large = RequestError(f"{kind}_too_large", f"the {kind} is over {size_text(policy.max_image_bytes)}", param)
        if declared is not None and declared > policy.max_image_bytes:
            raise too_large  # refused early; a smaller Content-Length is never trusted
        chunks, size = [], 0
        while chunk := response.read1(64 * 1024):
            size += len(chunk)
            if size > policy.max_image_bytes:
                raise too_large
            if time.monotonic() > deadline:
                raise TimeoutError
            chunks.append(chunk)
        if expired.is_set():
            raise TimeoutError
        if declared is not None and size < declared:  # read1 returns short bodies quietly
            raise RequestError("fetch_failed", f"the {kind} download ended early" + after, param)
        return b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as error:
        if expired.is_set() or isinstance(error, TimeoutError):  # socket.timeout is TimeoutError
            raise RequestError("fetch_timeout", late + after, param) from None
        log.info("%s fetch for %s failed", kind, param, exc_info=log.isEnabledFor(logging.DEBUG))
        raise RequestError("fetch_failed", f"the {kind} URL could not be fetched" + after, param) from None
    finally:
        watchdog.cancel()
        conn.close()


SVG_MESSAGE = "SVG images are not supported; send PNG, JPEG, WEBP, GIF, BMP or TIFF"
