"""runpod-vlm: a RunPod serverless worker that serves one vision-language model.

Sections, top to bottom: settings -> errors -> images -> family adapters -> model -> tasks ->
batching -> entry point. Importing this module is cheap: torch, transformers and runpod are imported
where they are used, and the model loads on the first job (or at boot under `python handler.py`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import io
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("runpod-vlm")

# =================================================================================================
# Settings
# =================================================================================================

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@dataclasses.dataclass(frozen=True)
class CuratedModel:
    family: str
    vram_gb: int  # approximate, bf16 weights plus a working margin
    license: str


CURATED_MODELS: dict[str, CuratedModel] = {
    "Qwen/Qwen2-VL-2B-Instruct": CuratedModel("qwen2-vl", 8, "Apache-2.0"),
    "Qwen/Qwen2-VL-7B-Instruct": CuratedModel("qwen2-vl", 20, "Apache-2.0"),
    "llava-hf/llava-1.5-7b-hf": CuratedModel("llava", 16, "Llama 2 Community License"),
    "llava-hf/llava-1.5-13b-hf": CuratedModel("llava", 30, "Llama 2 Community License"),
    "llava-hf/llava-v1.6-mistral-7b-hf": CuratedModel("llava-next", 18, "Apache-2.0"),
    "openbmb/MiniCPM-V-2_6": CuratedModel("minicpm-v", 20, "MiniCPM Model License"),
    "microsoft/Phi-3-vision-128k-instruct": CuratedModel("phi3-vision", 12, "MIT"),
    "OpenGVLab/InternVL2-8B": CuratedModel("internvl", 20, "MIT"),
}

QUANTIZE_CHOICES = ("none", "4bit", "8bit")
DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp32")


def _env_bool(env: dict, name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name} must be true or false, got {raw!r}")


def _env_int(env: dict, name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be at least {minimum}, got {value}")
    return value


def _env_choice(env: dict, name: str, default: str, choices: Iterable[str]) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise SettingsError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


class SettingsError(RuntimeError):
    """A deployment setting is wrong: the operator's mistake, reported at load time."""


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = DEFAULT_MODEL
    quantize: str = "none"
    dtype: str = "auto"
    device_map: str = "auto"
    trust_remote_code: bool = True
    allow_any: bool = False
    max_new_tokens_cap: int = 2048
    default_max_new_tokens: int = 256
    max_batch_size: int = 16  # rows per GPU batch
    max_batch_requests: int = 64  # items in one {"requests": [...]} call
    max_images: int = 16  # per request
    max_total_pixels: int = 64_000_000  # decoded pixels per request, all images together
    max_text_chars: int = 32_000  # all text of a request together
    max_messages: int = 64
    min_pixels: int = 0  # Qwen processors' visual-token bounds; 0 keeps the model's own
    max_pixels: int = 0
    compile: bool = True  # torch.compile + CUDA graphs for decoding (CUDA only, never bitsandbytes)
    cache_len: int = 2048  # KV-cache length compiled at warm-up; a longer request doubles it
    compile_cache_dir: str = ""  # compiled kernels kept here are reused by a restarted worker

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "Settings":
        env = dict(os.environ if env is None else env)
        return cls(
            model=(env.get("VLM_MODEL") or DEFAULT_MODEL).strip(),
            quantize=_env_choice(env, "VLM_QUANTIZE", "none", QUANTIZE_CHOICES),
            dtype=_env_choice(env, "VLM_DTYPE", "auto", DTYPE_CHOICES),
            device_map=(env.get("VLM_DEVICE_MAP") or "auto").strip(),
            trust_remote_code=_env_bool(env, "VLM_TRUST_REMOTE_CODE", True),
            allow_any=_env_bool(env, "VLM_ALLOW_ANY", False),
            max_new_tokens_cap=_env_int(env, "VLM_MAX_NEW_TOKENS", 2048, 1),
            default_max_new_tokens=_env_int(env, "VLM_DEFAULT_MAX_NEW_TOKENS", 256, 1),
            max_batch_size=_env_int(env, "VLM_MAX_BATCH_SIZE", 16, 1),
            max_batch_requests=_env_int(env, "VLM_MAX_BATCH_REQUESTS", 64, 1),
            max_images=_env_int(env, "VLM_MAX_IMAGES", 16, 1),
            max_total_pixels=_env_int(env, "VLM_MAX_TOTAL_PIXELS", 64_000_000, 1),
            max_text_chars=_env_int(env, "VLM_MAX_TEXT_CHARS", 32_000, 1),
            max_messages=_env_int(env, "VLM_MAX_MESSAGES", 64, 1),
            min_pixels=_env_int(env, "VLM_MIN_PIXELS", 0),
            max_pixels=_env_int(env, "VLM_MAX_PIXELS", 0),
            compile=_env_bool(env, "VLM_COMPILE", True),
            cache_len=_env_int(env, "VLM_CACHE_LEN", 2048, 256),
            compile_cache_dir=env.get("VLM_COMPILE_CACHE_DIR")
            or (os.path.join(env["HF_HOME"], "compile-cache") if env.get("HF_HOME") else ""),
        )


# =================================================================================================
# Errors
# =================================================================================================

# Caller text quoted back in an error (a field name, a value) is cut to a short prefix, so an error
# answer stays a few KB whatever the request held, and made encodable as UTF-8: the SDK never posts
# an answer that holds a lone surrogate, so the job would be lost.
MAX_ECHO_CHARS = 64  # one quoted name or value
MAX_PARAM_CHARS = 256  # a whole field path
MAX_MESSAGE_CHARS = 1024


def _cut(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` fit to quote in an answer: at most `limit` characters then '…'; a lone surrogate
    becomes its escape (\\udc80)."""
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _quote(value: Any) -> str:
    """A caller's value quoted in a message, cut: 'abc…'."""
    return repr(_cut(value if isinstance(value, str) else repr(value)))


class RequestError(Exception):
    """A request the worker refuses. `param` names the field at fault, `code` is stable for clients."""

    def __init__(self, code: str, message: str, param: Optional[str] = None):
        message = _cut(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = _cut(param, MAX_PARAM_CHARS) if param else param

    def to_dict(self) -> dict:
        text = f"{self.param}: {self.message}" if self.param else self.message
        return {"error": text, "code": self.code, "param": self.param}


def _join(param: Optional[str], child: str) -> str:
    if not param:
        return child
    return f"{param}{child}" if child.startswith("[") else f"{param}.{child}"


# =================================================================================================
# Images
# =================================================================================================

# Images come from strangers: the worker fetches URLs from inside the datacenter (SSRF) and decodes
# whatever bytes arrive (bombs, broken files). Policy (after NVIDIA Dynamo's media URL policy, see
# README "Security"): https and base64/data URIs only; no internal addresses; pinned DNS; redirects
# re-checked by hand; one deadline; byte and pixel caps; fixed error messages that echo nothing.

MAX_URL_CHARS = 16 * 1024
MAX_REDIRECTS = 3
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_BLOCKED_NAMES = ("localhost", "localhost.localdomain", "metadata.google.internal")
_BLOCKED_SUFFIXES = (".localhost", ".local", ".internal", ".localdomain", ".home.arpa")
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_HOST_LABELS = re.compile(r"[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_\-]{0,61}[a-z0-9_])?)*")
_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:@]+)(?::(\d{1,5}))?")


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """How images may reach the worker. Read from the environment at each resolve (cheap)."""

    allow_internal: bool = False  # VLM_ALLOW_INTERNAL_URLS: http:// and internal addresses too
    allow_http: bool = False  # plain http:// (opened by allow_internal; code may set it alone)
    allowed_domains: tuple[str, ...] = ()  # VLM_URL_ALLOWED_DOMAINS: suffix match, narrows further
    trust_env_proxy: bool = False  # VLM_TRUST_ENV_PROXY: use HTTP(S)_PROXY / NO_PROXY
    fetch_timeout: float = 20.0  # VLM_FETCH_TIMEOUT: seconds for a whole fetch, all hops
    fetch_deadline: float = 30.0  # VLM_FETCH_DEADLINE: seconds for all the fetches of one request
    max_image_bytes: int = 64 * 1024 * 1024  # VLM_MAX_IMAGE_BYTES: downloaded or local file bytes
    max_base64_bytes: int = 16 * 1024 * 1024  # VLM_MAX_BASE64_BYTES: encoded length of base64 text
    max_image_pixels: int = 40_000_000  # VLM_MAX_IMAGE_PIXELS: width*height, from the header
    min_image_side: int = 8  # VLM_MIN_IMAGE_SIDE: pixels, both sides
    media_dir: Optional[str] = None  # VLM_MEDIA_DIR: local files only from inside this folder

    @classmethod
    def from_env(cls, env: Optional[dict] = None) -> "MediaPolicy":
        env = dict(os.environ if env is None else env)
        allow_internal = _env_bool(env, "VLM_ALLOW_INTERNAL_URLS", False)
        domains = tuple(
            d.strip().strip(".").lower()
            for d in (env.get("VLM_URL_ALLOWED_DOMAINS") or "").split(",") if d.strip().strip(".")
        )
        media_dir = (env.get("VLM_MEDIA_DIR") or "").strip() or None
        return cls(
            allow_internal=allow_internal,
            allow_http=allow_internal,
            allowed_domains=domains,
            trust_env_proxy=_env_bool(env, "VLM_TRUST_ENV_PROXY", False),
            fetch_timeout=_env_seconds(env, "VLM_FETCH_TIMEOUT", 20.0),
            fetch_deadline=_env_seconds(env, "VLM_FETCH_DEADLINE", 30.0),
            max_image_bytes=_env_int(env, "VLM_MAX_IMAGE_BYTES", 64 * 1024 * 1024, 1),
            max_base64_bytes=_env_int(env, "VLM_MAX_BASE64_BYTES", 16 * 1024 * 1024, 1),
            max_image_pixels=_env_int(env, "VLM_MAX_IMAGE_PIXELS", 40_000_000, 1),
            min_image_side=_env_int(env, "VLM_MIN_IMAGE_SIDE", 8, 1),
            media_dir=media_dir,
        )


def _env_seconds(env: dict, name: str, default: float) -> float:
    raw = (env.get(name) or "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 < value <= 600:
        raise SettingsError(f"{name} must be above 0 and at most 600, got {raw!r}")
    return value


def _size_text(n: int) -> str:
    return f"{n // (1024 * 1024)} MiB" if n >= 1024 * 1024 and n % (1024 * 1024) == 0 else f"{n} bytes"


def resolve_image(spec: Any, param: str, policy: Optional[MediaPolicy] = None):
    """Turn one image spec (https URL, data URI, raw base64, local path or {"url": ...}) into an RGB
    PIL image, or raise RequestError with a fixed message and `param` naming the field at fault."""
    text, param = image_source(spec, param)
    policy = policy or MediaPolicy.from_env()
    return _decode_image(_image_bytes(text, policy, param), policy, param)


def image_source(spec: Any, param: str) -> tuple[str, str]:
    """An image spec's text and the field that holds it ({"url": text} -> param.url)."""
    if isinstance(spec, dict):
        if "url" not in spec:
            raise RequestError("invalid_image", "an image object needs a 'url' field", param)
        spec, param = spec["url"], _join(param, "url")
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError("invalid_image", "an image must be a URL, a data URI or base64 text", param)
    return spec.strip(), param


def _image_bytes(spec: str, policy: MediaPolicy, param: str, deadline: Optional[float] = None) -> bytes:
    """The bytes an image spec names; `deadline` (time.monotonic()) bounds a URL fetch further."""
    if spec[:5].lower() == "data:":
        return _data_uri_bytes(spec, policy, param)
    scheme = _URL_SCHEME.match(spec)
    if scheme:
        name = scheme.group(1).lower()
        if name in ("http", "https"):
            return fetch_image_url(spec, policy, param, deadline)
        if name == "file":
            return _local_file_bytes(spec, True, policy, param)
        raise RequestError(
            "invalid_image_url", "unsupported URL scheme; send an https URL, a data URI or base64", param
        )
    if _looks_like_path(spec):
        return _local_file_bytes(spec, False, policy, param)
    return _base64_bytes(spec, policy, param)


def _looks_like_path(spec: str) -> bool:
    """Base64 never holds '.' or '~'; it may start with '/' (JPEG: "/9j/"), but no JPEG encodes
    to under 128 characters, so a short "/..." is a path. Other paths need file:// or a '.'."""
    return "." in spec or spec.startswith("~") or (spec.startswith("/") and len(spec) < 128)


# ---- base64 and data URIs -----------------------------------------------------------------------


def _data_uri_bytes(spec: str, policy: MediaPolicy, param: str) -> bytes:
    header, comma, payload = spec[5:1029].partition(",")
    if not comma:
        raise RequestError("invalid_image_url", "a data URI needs a ',' after its header", param)
    fields = [f.strip().lower() for f in header.split(";")]
    if fields[0] == "image/svg+xml":
        raise RequestError("unsupported_image_format", _SVG_MESSAGE, param)
    if "base64" not in fields[1:]:
        raise RequestError("invalid_image_url", "only base64 data URIs are supported (data:image/png;base64,...)", param)
    return _base64_bytes(spec[5 + len(header) + 1:], policy, param)


def _base64_bytes(text: str, policy: MediaPolicy, param: str) -> bytes:
    """Strict base64 with two kind exceptions: line breaks (MIME/`base64` CLI output) and the
    URL-safe alphabet with or without padding (JWT-style encoders); never both alphabets mixed."""
    if len(text) > policy.max_base64_bytes:
        raise RequestError(
            "image_too_large", f"the base64 image is over {_size_text(policy.max_base64_bytes)} encoded", param
        )
    compact = "".join(text.split())
    if "-" in compact or "_" in compact:
        if "+" in compact or "/" in compact:
            raise RequestError("invalid_base64", "the image mixes standard and URL-safe base64 alphabets", param)
        compact = compact.translate(str.maketrans("-_", "+/"))
    if "=" not in compact:
        if len(compact) % 4 == 1:
            raise RequestError("invalid_base64", "the image is not valid base64 (wrong length)", param)
        compact += "=" * (-len(compact) % 4)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("invalid_base64", "the image is not valid base64", param) from None
    if not data:
        raise RequestError("invalid_base64", "the base64 image is empty", param)
    return data


# ---- local files --------------------------------------------------------------------------------


def _local_file_bytes(spec: str, is_url: bool, policy: MediaPolicy, param: str) -> bytes:
    import stat
    import urllib.parse

    if not policy.media_dir:
        raise RequestError(
            "blocked_url", "local files are disabled on this worker; send an https URL or base64", param
        )
    path = spec
    if is_url:
        parts = urllib.parse.urlsplit(spec)
        if parts.netloc.lower() not in ("", "localhost") or parts.query or parts.fragment:
            raise RequestError("invalid_image_url", "a file URL must look like file:///path/in/media/dir", param)
        path = urllib.parse.unquote(parts.path)
    if "\x00" in path or "\\" in path or ".." in path.split("/"):
        raise RequestError("blocked_url", "the path may not contain '..', backslashes or NUL", param)
    base = os.path.realpath(policy.media_dir)
    real = os.path.realpath(path if path.startswith("/") else os.path.join(base, path))
    if os.path.commonpath([base, real]) != base or real == base:
        raise RequestError("blocked_url", "the path is outside the media directory", param)
    try:  # O_NOFOLLOW|O_NONBLOCK: a symlink swapped in after realpath, or a FIFO, cannot hang or escape
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RequestError("fetch_failed", "no such file in the media directory", param) from None
    except OSError:
        raise RequestError("fetch_failed", "the local image could not be read", param) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RequestError("fetch_failed", "the local path is not a regular file", param)
        data = file.read(policy.max_image_bytes + 1)
    if len(data) > policy.max_image_bytes:
        raise RequestError("image_too_large", f"the image is over {_size_text(policy.max_image_bytes)}", param)
    return data


# ---- URL policy ---------------------------------------------------------------------------------


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
    import ipaddress

    if ip.version == 6:
        if ip.ipv4_mapped is not None or ip.is_site_local:
            return True
        embedded = [ip.sixtofour, *(ip.teredo or ())]  # 6to4/Teredo carry an IPv4 inside
        if any(e is not None and ip_is_blocked(e) for e in embedded):
            return True
    elif ip in ipaddress.ip_network("100.64.0.0/10"):
        return True
    return (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
        or ip.is_unspecified or not ip.is_global
    )


def _whatwg_ipv4(host: str) -> Optional[int]:
    """The WHATWG URL IPv4 parser (what browsers and inet_aton accept: 127.1, 0x7f.1, 0177.0.0.1,
    2130706433); no library exposes it, and getaddrinfo would quietly accept these spellings."""
    parts = host.split(".")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    if not 1 <= len(parts) <= 4:
        return None
    numbers = []
    for part in parts:
        base, digits = 10, part
        if part[:2] in ("0x", "0X"):
            base, digits = 16, part[2:]
        elif len(part) > 1 and part[0] == "0":
            base, digits = 8, part[1:]
        if digits == "":
            numbers.append(0)
            continue
        try:
            numbers.append(int(digits, base))
        except ValueError:
            return None
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        return None
    value = numbers[-1]
    for i, n in enumerate(numbers[:-1]):
        value += n << (8 * (3 - i))
    return value


def _ends_in_number(host: str) -> bool:
    last = host.rstrip(".").rsplit(".", 1)[-1] if host.rstrip(".") else ""
    return bool(re.fullmatch(r"[0-9]+|0[xX][0-9A-Fa-f]*", last))


def check_image_url(url: str, policy: MediaPolicy, param: str, redirected: bool = False) -> ImageURL:
    """Validate and normalise one URL without touching the network (DNS comes later)."""
    import ipaddress
    import unicodedata
    import urllib.parse

    after = " (after a redirect)" if redirected else ""

    def refuse(code: str, message: str):
        raise RequestError(code, message + after, param)

    if len(url) > MAX_URL_CHARS:
        refuse("invalid_image_url", f"the image URL is over {MAX_URL_CHARS} characters")
    if "\\" in url or any(unicodedata.category(c)[0] in "CZ" for c in url):
        refuse("invalid_image_url", "the image URL holds a backslash, whitespace or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        refuse("invalid_image_url", "the image URL could not be parsed")
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        refuse("invalid_image_url", "the image URL must use https")
    if scheme == "http" and not (policy.allow_http or policy.allow_internal):
        refuse("blocked_url", "plain http image URLs are not allowed; use https")
    if "@" in parts.netloc:
        refuse("blocked_url", "the image URL may not carry credentials (user@host)")
    authority = _AUTHORITY.fullmatch(parts.netloc)
    if not authority:
        refuse("invalid_image_url", "the image URL has no valid host")
    raw_host, raw_port = authority.groups()
    port = int(raw_port) if raw_port else (443 if scheme == "https" else 80)
    if not 0 < port < 65536:
        refuse("invalid_image_url", "the image URL has an invalid port")
    ip = None
    if raw_host.startswith("["):
        try:
            ip = ipaddress.IPv6Address(raw_host[1:-1])
        except ValueError:
            refuse("invalid_image_url", "the image URL has an invalid IPv6 address")
        host = str(ip)
    else:
        try:
            host = raw_host.encode("idna").decode("ascii").lower() if not raw_host.isascii() else raw_host.lower()
        except UnicodeError:
            refuse("invalid_image_url", "the image URL has an invalid host name")
        if host.endswith(".") and not host.endswith(".."):
            host = host[:-1]
        if _ends_in_number(host):
            value = _whatwg_ipv4(host)
            if value is None:
                refuse("invalid_image_url", "the image URL has an invalid numeric host")
            ip = ipaddress.IPv4Address(value)
            if not policy.allow_internal and ip_is_blocked(ip):
                refuse("blocked_url", "the image URL points at an internal or reserved address")
            if host != str(ip):
                refuse("invalid_image_url", "write a numeric host as four decimal parts (a.b.c.d)")
        elif not _HOST_LABELS.fullmatch(host) or len(host) > 253:
            refuse("invalid_image_url", "the image URL has an invalid host name")
    if ip is not None and not policy.allow_internal and ip_is_blocked(ip):
        refuse("blocked_url", "the image URL points at an internal or reserved address")
    if ip is None and not policy.allow_internal:
        if host in _BLOCKED_NAMES or host.endswith(_BLOCKED_SUFFIXES) or "." not in host:
            refuse("blocked_url", "the image URL names an internal host")
    if policy.allowed_domains and not any(
        host == d or (ip is None and host.endswith("." + d)) for d in policy.allowed_domains
    ):
        refuse("blocked_url", "the image URL's host is not on this worker's allow-list")
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=-._~?")
    return ImageURL(scheme, host, port, path + (f"?{query}" if parts.query else ""), ip)


def _resolve(target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str) -> list:
    """Every DNS answer, each checked: one blocked answer refuses the URL (no racing A/AAAA)."""
    import ipaddress
    import socket

    if target.ip is not None:
        return [target.ip]
    remaining = deadline - time.monotonic()
    future = _dns_pool().submit(socket.getaddrinfo, target.host, target.port, 0, socket.SOCK_STREAM)
    try:  # getaddrinfo has no timeout of its own: wait on it from here, under the fetch's deadline
        answers = future.result(timeout=max(remaining, 0.001))
    except TimeoutError:
        raise RequestError("fetch_timeout", "the image URL's host did not resolve in time" + after, param) from None
    except (OSError, UnicodeError):
        raise RequestError("fetch_failed", "the image URL's host could not be resolved" + after, param) from None
    addresses = []
    for family, _, _, _, sockaddr in answers:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not policy.allow_internal and ip_is_blocked(ip):
            log.warning("image fetch refused: the host of %s resolves to a blocked address", param)
            raise RequestError("blocked_url", "the image URL's host resolves to an internal address" + after, param)
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise RequestError("fetch_failed", "the image URL's host could not be resolved" + after, param)
    return addresses


_dns_executor = None


def _dns_pool():
    global _dns_executor
    with _media_lock:
        if _dns_executor is None:
            import concurrent.futures

            # Shared by every job in flight: wide enough that a few names whose DNS stalls (a
            # stranger's own name server can) do not hold up the other jobs' lookups.
            _dns_executor = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="vlm-dns")
    return _dns_executor


def _tls_context():
    """System trust (honours SSL_CERT_FILE / SSL_CERT_DIR); certifi's bundle when it is installed
    and no override is set, as requests does."""
    return _tls_context_for(os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None)


@functools.lru_cache(maxsize=4)
def _tls_context_for(cafile: Optional[str], cadir: Optional[str]):
    """Built once per trust setting: loading a CA bundle takes tens of milliseconds."""
    import ssl

    if cafile is None and not cadir:
        try:
            import certifi

            cafile = certifi.where()
        except ImportError:
            pass
    context = ssl.create_default_context(cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _connect_pinned(addresses: list, port: int, policy: MediaPolicy, deadline: float, param: str):
    """Connect to an address that passed the checks, never to a fresh DNS answer (DNS rebinding)."""
    import socket

    last: Optional[OSError] = None
    for ip in addresses:
        if not policy.allow_internal and ip_is_blocked(ip):  # checked again at connect time
            raise RequestError("blocked_url", "the image URL points at an internal address", param)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            return socket.create_connection((str(ip), port), timeout=remaining)
        except OSError as error:
            last = error
    raise last or OSError("no address")


def _pinned_connection(target: ImageURL, addresses: list, policy: MediaPolicy, deadline: float, param: str):
    import functools

    pin = functools.partial(_connect_pinned, addresses, target.port, policy, deadline, param)
    timeout = max(deadline - time.monotonic(), 0.001)
    http_class, https_class = _pinned_classes()
    if target.scheme == "http":
        return http_class(target.host, target.port, pin, timeout=timeout)
    return https_class(target.host, target.port, pin, _tls_context(), timeout=timeout)


_pinned_cache: list = []
_media_lock = threading.Lock()


def _pinned_classes():
    """http.client connections whose connect() uses the checked addresses: the Host header, SNI and
    certificate check keep the name. (Built on first use: http.client stays out of import time.)"""
    with _media_lock:
        if not _pinned_cache:
            _pinned_cache.extend(_build_pinned_classes())
    return _pinned_cache


def _build_pinned_classes():
    import http.client

    class PinnedHTTPConnection(http.client.HTTPConnection):
        def __init__(self, host, port, pin, **kwargs):
            super().__init__(host, port, **kwargs)
            self.pin = pin

        def connect(self):
            self.sock = self.pin()

    class PinnedHTTPSConnection(http.client.HTTPSConnection):
        def __init__(self, host, port, pin, context, **kwargs):
            super().__init__(host, port, context=context, **kwargs)
            self.pin, self.tls = pin, context

        def connect(self):
            self.sock = self.tls.wrap_socket(self.pin(), server_hostname=self.host)

    return PinnedHTTPConnection, PinnedHTTPSConnection


def _proxy_connection(target: ImageURL, policy: MediaPolicy, deadline: float):
    """The environment's proxy for this URL, only when the operator trusts it (the proxy resolves
    names itself, so pinning is the proxy's business then). Returns (connection, request target)."""
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
        token = base64.b64encode(
            f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}".encode()
        ).decode()
        headers["Proxy-Authorization"] = f"Basic {token}"
    timeout = max(deadline - time.monotonic(), 0.001)
    if target.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port or 8080, timeout=timeout, context=_tls_context())
        conn.set_tunnel(target.host, target.port, headers=headers)
        return conn, target.target, {}
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 8080, timeout=timeout)
    return conn, target.url, headers


def fetch_image_url(url: str, policy: MediaPolicy, param: str, request_deadline: Optional[float] = None) -> bytes:
    """GET an image under the policy: each hop checked, pinned, capped, all under one deadline
    (VLM_FETCH_TIMEOUT, or the request's own when that comes first)."""
    deadline = time.monotonic() + policy.fetch_timeout
    late = f"the image URL took over {policy.fetch_timeout:g}s"
    if request_deadline is not None and request_deadline < deadline:
        deadline, late = request_deadline, f"the request's images took over {policy.fetch_deadline:g}s to download"
    target = check_image_url(url, policy, param)
    for hop in range(MAX_REDIRECTS + 1):
        location = _fetch_once(target, policy, deadline, param, " (after a redirect)" if hop else "", late)
        if isinstance(location, bytes):
            return location
        if hop == MAX_REDIRECTS:
            raise RequestError("fetch_failed", f"the image URL redirected more than {MAX_REDIRECTS} times", param)
        import urllib.parse

        target = check_image_url(urllib.parse.urljoin(target.url, location), policy, param, redirected=True)
    raise AssertionError("unreachable")


def _fetch_once(target: ImageURL, policy: MediaPolicy, deadline: float, param: str, after: str, late: str):
    """One request: the body (bytes) or a redirect's Location (str). `late` says which deadline passed."""
    import http.client
    import socket

    via_proxy = _proxy_connection(target, policy, deadline)
    addresses = _resolve(target, policy, deadline, param, after)
    if via_proxy:
        conn, request_target, headers = via_proxy
    else:
        conn, request_target, headers = _pinned_connection(target, addresses, policy, deadline, param), target.target, {}
    headers.update({"User-Agent": "runpod-vlm image fetch", "Accept": "image/*", "Accept-Encoding": "identity"})
    expired = threading.Event()

    def abort():  # the deadline covers slow headers too (a per-read timeout never fires on a drip)
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), abort)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.request("GET", request_target, headers=headers)
        response = conn.getresponse()
        if response.status in _REDIRECT_STATUSES:
            location = response.getheader("Location")
            if not location:
                raise RequestError("fetch_failed", "the image URL redirected without a Location" + after, param)
            return location.strip()
        if response.status != 200:
            raise RequestError("fetch_failed", f"the image URL answered HTTP {response.status}" + after, param)
        content_type = (response.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if content_type == "image/svg+xml":
            raise RequestError("unsupported_image_format", _SVG_MESSAGE, param)
        declared = response.getheader("Content-Length") or ""
        too_large = RequestError("image_too_large", f"the image is over {_size_text(policy.max_image_bytes)}", param)
        if declared.strip().isdigit() and int(declared) > policy.max_image_bytes:
            raise too_large  # refused early; a smaller Content-Length is never trusted
        chunks, size = [], 0
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError
            chunk = response.read1(64 * 1024)
            if not chunk:
                break
            size += len(chunk)
            if size > policy.max_image_bytes:
                raise too_large
            chunks.append(chunk)
        if expired.is_set():
            raise TimeoutError
        if declared.strip().isdigit() and size < int(declared):  # read1 returns short bodies quietly
            raise RequestError("fetch_failed", "the image download ended early" + after, param)
        return b"".join(chunks)
    except RequestError:
        raise
    except (TimeoutError, socket.timeout):
        raise RequestError("fetch_timeout", late + after, param) from None
    except (OSError, http.client.HTTPException, ValueError):
        if expired.is_set():
            raise RequestError("fetch_timeout", late + after, param) from None
        log.info("image fetch for %s failed", param, exc_info=log.isEnabledFor(logging.DEBUG))
        raise RequestError("fetch_failed", "the image URL could not be fetched" + after, param) from None
    finally:
        watchdog.cancel()
        conn.close()


# ---- decoding -----------------------------------------------------------------------------------

_SVG_MESSAGE = "SVG images are not supported; send PNG, JPEG, WEBP, GIF, BMP or TIFF"
_OTHER_FORMATS = (
    (b"8BPS", "PSD"), (b"%PDF", "PDF"), (b"\x00\x00\x01\x00", "ICO"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"qoif", "QOI"), (b"SIMPLE  =", "FITS"),
)


def _sniff_other(data: bytes) -> Optional[str]:
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith((b"<svg", b"<?xml", b"<!doctype svg", b"<!--")) and b"<svg" in data[:4096].lower():
        return "SVG"
    if data[4:8] == b"ftyp" and data[8:12] in (b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"):
        return "HEIC/AVIF"
    return next((name for magic, name in _OTHER_FORMATS if data.startswith(magic)), None)


def _decode_image(data: bytes, policy: MediaPolicy, param: str):
    """Bytes -> RGB image: allowed formats only, pixel cap from the header, frame 0, EXIF
    orientation, every mode to RGB (alpha over white). Messages are fixed: PIL's text leaks."""
    from PIL import Image, ImageOps

    allowed = ", ".join(IMAGE_FORMATS[:-1]) + " or " + IMAGE_FORMATS[-1]
    other = _sniff_other(data)
    if other == "SVG":
        raise RequestError("unsupported_image_format", _SVG_MESSAGE, param)
    if other:
        raise RequestError("unsupported_image_format", f"{other} images are not supported; send {allowed}", param)
    if not data:
        raise RequestError("invalid_image_format", "the image is empty", param)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise RequestError("image_too_large", f"the image is over {policy.max_image_pixels} pixels", param) from None
    except Exception:  # UnidentifiedImageError and the plugins' own errors alike
        raise RequestError("invalid_image_format", f"the data is not a {allowed} image", param) from None
    with image:
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise RequestError(
                "image_too_large",
                f"the image is {width}x{height}, over {policy.max_image_pixels} pixels", param,
            )
        if min(width, height) < policy.min_image_side:
            raise RequestError(
                "image_too_small",
                f"the image is {width}x{height}; each side must be at least {policy.min_image_side} pixels", param,
            )
        try:
            image.seek(0)  # frame 0 of animations
            image.load()
            try:
                oriented = ImageOps.exif_transpose(image)
            except Exception:  # a broken EXIF block costs the orientation, not the request
                oriented = image
            return _to_rgb(oriented)
        except Image.DecompressionBombError:
            raise RequestError("image_too_large", f"the image is over {policy.max_image_pixels} pixels", param) from None
        except MemoryError:
            raise RequestError("image_too_large", "the image is too large to decode", param) from None
        except Exception:
            raise RequestError("invalid_image_format", "the image is truncated or corrupt", param) from None


def _to_rgb(image):
    """Any Pillow mode -> RGB. 16/32-bit and float greys are scaled, not clipped to white."""
    from PIL import Image

    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        low, high = image.getextrema()
        if mode.startswith("I;16") or (mode == "I" and 255 < high <= 65535 and low >= 0):
            scale, offset = 1 / 256, 0.0
        elif mode == "F" and low >= 0 and high <= 1.0:
            scale, offset = 255.0, 0.0
        elif low >= 0 and high <= 255:
            scale, offset = 1.0, 0.0
        else:
            scale = 255.0 / (high - low) if high > low else 1.0
            offset = -low * scale
        image = image.convert("F" if mode == "F" else "I").point(lambda v: v * scale + offset).convert("L")
        mode = "L"
    if mode == "LAB":  # Pillow's plain LAB->RGB convert copies channels; colour management is right
        from PIL import ImageCms

        transform = ImageCms.buildTransform(ImageCms.createProfile("LAB"), ImageCms.createProfile("sRGB"), "LAB", "RGB")
        return ImageCms.applyTransform(image, transform)
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa") or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    return image.convert("RGB")


# =================================================================================================
# Family adapters
# =================================================================================================

# A request, once validated, is a list of turns; each turn holds text and PIL images in order.


@dataclasses.dataclass
class Turn:
    role: str
    parts: list  # str or PIL.Image.Image, in order


@dataclasses.dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float
    top_p: float
    do_sample: bool
    min_new_tokens: int = 0


@dataclasses.dataclass
class GenerationRequest:
    """One validated item, ready for the engine."""

    task: str
    turns: list[Turn]
    params: GenerationParams
    grounding_target: Optional[str] = None
    param: Optional[str] = None  # where the request sits in the job, e.g. "requests[3]"

    @property
    def images(self) -> list:
        return [p for t in self.turns for p in t.parts if not isinstance(p, str)]


@dataclasses.dataclass
class Generation:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw_text: Optional[str] = None  # with special tokens, for box parsing
    image_input_size: Optional[tuple[int, int]] = None  # first image as the model saw it (boxes)


class FamilyAdapter:
    """How one model family turns turns into prompts, and which prompts it uses for tasks."""

    name = "generic"
    native = True  # loads with AutoProcessor + AutoModelForImageTextToText, no remote code
    grounding: Optional[str] = None  # coordinate system of boxes: "qwen-1000", "qwen-abs-pixels", None
    quantization_skip_modules: tuple[str, ...] = ()

    def grounding_prompt(self, target: str) -> str:
        return f"Locate {target} in the image and give its bounding box as [x1, y1, x2, y2]."

    def request_turns(self, item: "GenerationRequest") -> list[Turn]:
        """The turns the model is prompted with: a grounding request's last turn gets the family's
        grounding prompt after its images."""
        if item.task != "grounding":
            return item.turns
        *before, last = item.turns
        return [*before, Turn(last.role, [*last.parts, self.grounding_prompt(item.grounding_target)])]

    def chat_messages(self, turns: list[Turn]) -> list[dict]:
        """Turns in the format processors' chat templates take: images become {"type": "image"}."""
        return [
            {
                "role": turn.role,
                "content": [
                    {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                    for p in turn.parts
                ],
            }
            for turn in turns
        ]

    def prompt(self, processor, turns: list[Turn]) -> str:
        return processor.apply_chat_template(
            self.chat_messages(turns), add_generation_prompt=True, tokenize=False
        )

    def batch_inputs(self, processor, items: list["GenerationRequest"], device, dtype):
        """Chat-templated prompts and pixels for a batch, left-padded, on `device`; and for each item
        the size its first image was resized to (the frame of boxes in input pixels), or None."""
        prompts = [self.prompt(processor, self.request_turns(item)) for item in items]
        images = [item.images for item in items]
        kwargs: dict = {"text": prompts, "padding": True, "return_tensors": "pt"}
        if any(images):
            kwargs["images"] = images if len(items) > 1 else images[0]
        inputs = processor(**kwargs).to(device)
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        input_sizes: list = [None] * len(items)
        if "image_grid_thw" in inputs:  # Qwen2.5-VL boxes are in pixels of this resized input
            patch = processor.image_processor.patch_size
            grids = iter(inputs["image_grid_thw"].tolist())
            for row, group in enumerate(images):
                sizes = [next(grids) for _ in group]
                if sizes:
                    _, rows, cols = sizes[0]
                    input_sizes[row] = (cols * patch, rows * patch)
        return inputs, input_sizes

    def processor_kwargs(self, settings: Settings) -> dict:
        return {}


class QwenVLAdapter(FamilyAdapter):
    name = "qwen2-vl"
    grounding = "qwen-1000"
    quantization_skip_modules = ("model.visual", "lm_head")

    def grounding_prompt(self, target: str) -> str:
        return f"Find <|object_ref_start|>{target}<|object_ref_end|>"

    def processor_kwargs(self, settings: Settings) -> dict:
        kwargs = {}
        if settings.min_pixels:
            kwargs["min_pixels"] = settings.min_pixels
        if settings.max_pixels:
            kwargs["max_pixels"] = settings.max_pixels
        return kwargs


class Qwen25VLAdapter(QwenVLAdapter):
    name = "qwen2.5-vl"
    grounding = "qwen-abs-pixels"

    def grounding_prompt(self, target: str) -> str:
        return f"Locate {target} in the image, and output its bbox coordinates in JSON format."


class LlavaAdapter(FamilyAdapter):
    name = "llava"
    quantization_skip_modules = ("model.vision_tower", "model.multi_modal_projector", "lm_head")


class LlavaNextAdapter(LlavaAdapter):
    name = "llava-next"


class RemoteCodeAdapter(FamilyAdapter):
    """Families served through their repository's own code (trust_remote_code), one item at a time."""

    native = False
    model_class, processor_class = "AutoModel", "AutoTokenizer"  # names in transformers

    def load(self, path: str, load_kwargs: dict):
        import transformers

        model = getattr(transformers, self.model_class).from_pretrained(path, **load_kwargs).eval()
        processor = getattr(transformers, self.processor_class).from_pretrained(path, trust_remote_code=True)
        return model, processor

    def run(self, model, processor, item: GenerationRequest, sampling: dict) -> Generation:
        raise NotImplementedError


class MiniCPMVAdapter(RemoteCodeAdapter):
    """openbmb/MiniCPM-V-2_6: `model.chat(image=None, msgs=[...], tokenizer=...)` per its card."""

    name = "minicpm-v"
    quantization_skip_modules = ("vpm", "resampler", "lm_head")

    def run(self, model, tokenizer, item, sampling):
        msgs, system = [], None
        for turn in self.request_turns(item):
            if turn.role == "system":
                system = " ".join(p for p in turn.parts if isinstance(p, str))
                continue
            msgs.append({"role": turn.role, "content": list(turn.parts)})
        kwargs = dict(image=None, msgs=msgs, tokenizer=tokenizer, **sampling)
        if system:
            kwargs["system_prompt"] = system
        text = model.chat(**kwargs)
        return _remote_generation(tokenizer, text, item.params.max_new_tokens)


class Phi3VisionAdapter(RemoteCodeAdapter):
    """microsoft/Phi-3-vision-128k-instruct: `<|image_N|>` placeholders + its processor + generate."""

    name = "phi3-vision"
    quantization_skip_modules = ("model.vision_embed_tokens", "lm_head")
    model_class, processor_class = "AutoModelForCausalLM", "AutoProcessor"

    def chat_messages(self, turns):
        messages, index = [], 0
        for turn in turns:
            pieces = []
            for part in turn.parts:
                if isinstance(part, str):
                    pieces.append(part)
                else:
                    index += 1
                    pieces.append(f"<|image_{index}|>")
            messages.append({"role": turn.role, "content": "\n".join(pieces)})
        return messages

    def run(self, model, processor, item, sampling):
        import torch

        prompt = processor.tokenizer.apply_chat_template(
            self.chat_messages(self.request_turns(item)), tokenize=False, add_generation_prompt=True
        )
        inputs = processor(prompt, item.images or None, return_tensors="pt").to(model.device)
        # The card passes the tokenizer's end token; the generation config's (<|end|>) ends turns too.
        eos = set(_token_ids(model.generation_config.eos_token_id)) | set(_token_ids(processor.tokenizer.eos_token_id))
        with torch.inference_mode():
            out = model.generate(**inputs, eos_token_id=sorted(eos), **sampling)
        new_tokens = out[0, inputs["input_ids"].shape[1]:]
        ids = new_tokens.tolist()
        text = processor.tokenizer.decode(new_tokens, skip_special_tokens=True)
        return Generation(
            text=text.strip(),
            finish_reason=_finish_reason(ids, eos, item.params.max_new_tokens),
            prompt_tokens=int(inputs["input_ids"].shape[1]),
            completion_tokens=_trimmed_length(ids, eos),
        )


class InternVL2Adapter(RemoteCodeAdapter):
    """OpenGVLab/InternVL2-*: the card's dynamic 448px tiling, then `model.chat(...)`."""

    name = "internvl"
    quantization_skip_modules = ("vision_model", "mlp1", "lm_head")
    image_size = 448
    max_tiles = 12
    mean = (0.485, 0.456, 0.406)
    std = (0.229, 0.224, 0.225)

    def tiles(self, image) -> list:
        """The card's `dynamic_preprocess`: the closest aspect-ratio grid of 448px tiles + a thumbnail."""
        width, height = image.size
        aspect = width / height
        sides = range(1, self.max_tiles + 1)
        grids = sorted(
            {(i, j) for i in sides for j in sides if i * j <= self.max_tiles}, key=lambda g: g[0] * g[1]
        )
        best, best_diff, area = (1, 1), float("inf"), width * height
        for cols, rows in grids:
            diff = abs(aspect - cols / rows)
            if diff < best_diff or (
                diff == best_diff and area > 0.5 * self.image_size**2 * cols * rows
            ):
                best, best_diff = (cols, rows), diff
        cols, rows = best
        size = self.image_size
        resized = image.resize((size * cols, size * rows))
        tiles = [
            resized.crop(((k % cols) * size, (k // cols) * size,
                          (k % cols + 1) * size, (k // cols + 1) * size))
            for k in range(cols * rows)
        ]
        if len(tiles) > 1:
            tiles.append(image.resize((size, size)))
        return tiles

    def pixel_values(self, images, dtype, device):
        import torch
        from torchvision.transforms import functional as F

        per_image = []
        for image in images:
            tiles = [
                F.normalize(F.to_tensor(t), self.mean, self.std) for t in self.tiles(image)
            ]
            per_image.append(torch.stack(tiles))
        if not per_image:
            return None, []
        values = torch.cat(per_image).to(dtype=dtype, device=device)
        return values, [len(p) for p in per_image]

    def run(self, model, tokenizer, item, sampling):
        # InternVL2's chat takes one question plus (question, answer) history pairs.
        history, pending = [], None
        for turn in self.request_turns(item):
            text = "\n".join(
                "<image>" if not isinstance(p, str) else p for p in turn.parts
            )
            if turn.role == "assistant" and pending is not None:
                history.append((pending, text))
                pending = None
            elif turn.role in ("user", "system"):
                pending = text if pending is None else f"{pending}\n{text}"
        values, num_patches = self.pixel_values(item.images, model.dtype, model.device)
        text = model.chat(
            tokenizer, values, pending or "", sampling,
            num_patches_list=num_patches or None, history=history or None,
        )
        return _remote_generation(tokenizer, text, item.params.max_new_tokens)


def _token_ids(value) -> list[int]:
    """A config's token id field (an int, a list of ints or None) as a list."""
    if isinstance(value, int):
        return [value]
    return [v for v in value or () if isinstance(v, int)]


def _remote_generation(tokenizer, text: str, max_new_tokens: int) -> Generation:
    """Remote-code chat() APIs return text only: count its tokens to tell `length` from `stop`."""
    count = len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
    return Generation(
        text=text.strip(),
        finish_reason="length" if count >= max_new_tokens else "stop",
        completion_tokens=count,
    )


ADAPTERS: dict[str, FamilyAdapter] = {
    a.name: a
    for a in (
        QwenVLAdapter(), Qwen25VLAdapter(), LlavaAdapter(), LlavaNextAdapter(),
        MiniCPMVAdapter(), Phi3VisionAdapter(), InternVL2Adapter(),
    )
}
FAMILY_BY_MODEL_TYPE = {
    "qwen2_vl": "qwen2-vl",
    "qwen2_5_vl": "qwen2.5-vl",
    "llava": "llava",
    "llava_next": "llava-next",
    "minicpmv": "minicpm-v",
    "phi3_v": "phi3-vision",
    "internvl_chat": "internvl",
}


def adapter_for(model_type: str) -> FamilyAdapter:
    """The adapter of a config's model_type; other native model types get the generic adapter."""
    family = FAMILY_BY_MODEL_TYPE.get(model_type)
    return ADAPTERS[family] if family else FamilyAdapter()


# =================================================================================================
# Model
# =================================================================================================


def _finish_reason(ids: list[int], eos: set, max_new_tokens: int) -> str:
    return "stop" if any(i in eos for i in ids) else ("length" if len(ids) >= max_new_tokens else "stop")


def _trimmed_length(ids: list[int], eos: set) -> int:
    for n, token in enumerate(ids):
        if token in eos:
            return n
    return len(ids)


class Decoder:
    """Decoding state for `rows` rows over a `length`-token static KV cache, kept between calls.

    A step (forward of the last tokens, repetition penalty, end-token blocking before
    min_new_tokens, greedy or temperature/top-p choice per row, bookkeeping) reads and writes only
    these fixed tensors. On the GPU the step is captured as a CUDA graph (one for batches with
    sampled rows, one without) and replayed, so a token costs one launch rather than generate()'s
    hundreds of Python-issued kernels. Greedy rows give the tokens of `model.generate(do_sample=False)`."""

    def __init__(self, engine: "Engine", rows: int, length: int):
        import torch
        from transformers import StaticCache

        model, device = engine.model, engine.model.device
        self.model, self.forward, self.rows, self.length = model, engine.decode_forward(), rows, length
        self.use_graph = engine.compiled
        self.graphs: dict = {}  # one CUDA graph per variant of the step: with or without sampling
        self.any_sample = False
        self.cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.is_eos[[i for i in engine.eos_ids if i < vocab]] = True
        penalty = getattr(model.generation_config, "repetition_penalty", None) or 1.0
        self.penalty = penalty if penalty != 1.0 else None
        self.seen = torch.zeros((rows, vocab), dtype=torch.bool, device=device) if self.penalty else None
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.token, self.cache_position, self.step = zeros(rows, 1), zeros(1), zeros(1)
        self.mask, self.generated = zeros(rows, length), zeros(rows, length)
        self.min_new, self.max_new, self.finished = zeros(rows), zeros(rows), zeros(rows, dtype=torch.bool)
        self.sample = zeros(rows, dtype=torch.bool)
        self.temperature, self.top_p = zeros(rows, dtype=torch.float), zeros(rows, dtype=torch.float)
        self.position = None  # shaped like the family's position ids on the first call

    def choose(self, logits) -> None:
        """Pick each row's next token from its logits, in place."""
        import torch

        logits = logits.float()
        if self.seen is not None:  # as transformers' RepetitionPenaltyLogitsProcessor
            penalized = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(self.seen, penalized, logits)
        blocked = (self.step < self.min_new)[:, None] & self.is_eos[None, :]
        logits = logits.masked_fill(blocked, float("-inf"))
        token = logits.argmax(dim=-1)
        if self.any_sample:
            token = torch.where(self.sample, self._sampled(logits), token)
        self.generated.index_copy_(1, self.step, token[:, None])
        self.finished |= self.is_eos[token] | (self.step + 1 >= self.max_new)
        if self.seen is not None:
            self.seen.scatter_(1, token[:, None], True)
        self.token.copy_(token[:, None])
        self.step += 1

    def _sampled(self, logits):
        """Temperature and top-p sampling, drawn as argmax(p / Exp(1)) so a CUDA graph can hold it."""
        import torch

        probs = torch.softmax(logits / self.temperature.clamp(min=1e-5)[:, None], dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs > self.top_p[:, None]
        probs = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
        return (probs / torch.empty_like(probs).exponential_(1)).argmax(dim=-1)

    def advance(self) -> None:
        """One decoding step: the last chosen tokens go through the model, the next are chosen."""
        output = self.forward(
            input_ids=self.token,
            attention_mask=self.mask,
            position_ids=self.position,
            past_key_values=self.cache,
            cache_position=self.cache_position,
            use_cache=True,
            logits_to_keep=1,
        )
        self.choose(output.logits[:, -1, :])
        self.position += 1
        self.cache_position += 1

    def run(self, inputs, params: list[GenerationParams]) -> list[list[int]]:
        import torch

        model, device = self.model, self.model.device
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        prompt_length = input_ids.shape[1]
        max_new_tokens = max(p.max_new_tokens for p in params)
        self.cache.reset()
        self.mask.fill_(1)  # positions not yet written are hidden by causality
        self.mask[:, :prompt_length] = attention_mask
        self.generated.zero_()
        self.step.zero_()
        self.finished.zero_()
        self.min_new.copy_(torch.tensor([p.min_new_tokens for p in params]))
        self.max_new.copy_(torch.tensor([p.max_new_tokens for p in params]))
        self.any_sample = any(p.do_sample for p in params)
        self.sample.copy_(torch.tensor([p.do_sample for p in params]))
        self.temperature.copy_(torch.tensor([p.temperature for p in params]))
        self.top_p.copy_(torch.tensor([p.top_p for p in params]))
        if self.seen is not None:
            self.seen.zero_()
            self.seen.scatter_(1, input_ids, True)
        model_inputs = dict(inputs)
        # Positions continue from the prompt's exactly as generate() continues them (M-RoPE too).
        position_ids = model._prepare_position_ids_for_generation(input_ids, model_inputs)
        output = model(
            **model_inputs,
            position_ids=position_ids,
            past_key_values=self.cache,
            cache_position=torch.arange(prompt_length, device=device),
            use_cache=True,
            logits_to_keep=1,
        )
        if self.position is None:
            self.position = torch.zeros_like(position_ids[..., -1:])
        self.position.copy_(position_ids[..., -1:] + 1)
        self.cache_position.fill_(prompt_length)
        self.choose(output.logits[:, -1, :])
        produced, replay = 1, self._replay()
        while produced < max_new_tokens:
            # Look for the end only every 16 tokens: each look waits for the GPU.
            if produced % 16 == 0 and bool(self.finished.all()):
                break
            replay()
            produced += 1
        tokens = self.generated[:, :produced].tolist()
        if self.use_graph and self.any_sample not in self.graphs:
            try:
                self._capture()
            except Exception:  # still correct without the graph, only slower
                log.warning("CUDA graph capture failed; decoding without it", exc_info=True)
                self.use_graph = False
        return tokens

    def _replay(self):
        graph = self.graphs.get(self.any_sample)
        return graph.replay if graph is not None else self.advance

    def _capture(self) -> None:
        """Record one step as a CUDA graph (after a first call has compiled the forward)."""
        import torch

        self.cache_position.zero_()  # any in-range state will do: the next call resets it
        self.step.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.advance()
        torch.cuda.current_stream().wait_stream(stream)
        self.cache_position.zero_()
        self.step.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.advance()
        self.graphs[self.any_sample] = graph


class Engine:
    """The loaded model, its processor and family adapter. One per process."""

    def __init__(self, settings: Settings, quantize: Optional[str] = None):
        self.settings = settings
        self.model_id = settings.model
        self.quantize = quantize or settings.quantize
        self.lock = threading.Lock()
        self._decoders: dict[tuple[int, int], Decoder] = {}  # by (rows, cache length)
        self._compiled_forward = None
        self._cache_len = settings.cache_len
        self._load()

    # ---- loading ----------------------------------------------------------------------------

    def _check_allowed(self) -> None:
        if self.model_id in CURATED_MODELS or self.settings.allow_any:
            return
        raise SettingsError(
            f"VLM_MODEL={self.model_id!r} is not on the curated list "
            f"({', '.join(CURATED_MODELS)}); set VLM_ALLOW_ANY=true to serve it anyway"
        )

    def _torch_dtype(self):
        import torch

        choice = self.settings.dtype
        if choice == "auto":
            if torch.cuda.is_available():
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            return torch.float32
        return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[choice]

    def quantization_config(self, dtype):
        """bitsandbytes settings that keep the vision tower and projector in full precision."""
        if self.quantize == "none":
            return None
        from transformers import BitsAndBytesConfig

        skip = list(self.adapter.quantization_skip_modules)
        if self.quantize == "4bit":
            return BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
                llm_int8_skip_modules=skip,
            )
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)

    def _load(self) -> None:
        from transformers import AutoConfig

        self._check_allowed()
        started = time.perf_counter()
        trust = self.settings.trust_remote_code
        config = AutoConfig.from_pretrained(self.model_id, trust_remote_code=trust)
        self.model_type = config.model_type
        self.adapter = adapter_for(self.model_type)
        if not self.adapter.native and not trust:
            raise SettingsError(
                f"{self.model_id} ({self.adapter.name}) needs its repository's code: "
                "set VLM_TRUST_REMOTE_CODE=true"
            )
        dtype = self._torch_dtype()
        self.dtype = dtype
        import transformers

        # transformers 4.x (which the remote-code families need) calls the dtype `torch_dtype`.
        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        load_kwargs = {dtype_key: dtype, "device_map": self.settings.device_map, "trust_remote_code": trust}
        quantization = self.quantization_config(dtype)
        if quantization is not None:
            load_kwargs["quantization_config"] = quantization
        if self.adapter.native:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            self.processor = AutoProcessor.from_pretrained(
                self.model_id, trust_remote_code=trust, **self.adapter.processor_kwargs(self.settings)
            )
            self.processor.tokenizer.padding_side = "left"
            self.model = AutoModelForImageTextToText.from_pretrained(
                self.model_id, **load_kwargs
            ).eval()
        else:
            self.model, self.processor = self.adapter.load(self.model_id, load_kwargs)
        self.eos_ids = self._eos_ids()
        text_config = self.model.config.get_text_config(decoder=True)
        self.context_length = getattr(text_config, "max_position_embeddings", None)
        self.compiled = self._can_compile()
        log.info("loaded %s (%s) in %.1fs", self.model_id, self.adapter.name, time.perf_counter() - started)

    def _eos_ids(self) -> set:
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        return set(_token_ids(config_eos)) | set(_token_ids(getattr(self.tokenizer, "eos_token_id", None)))

    @property
    def tokenizer(self):
        return getattr(self.processor, "tokenizer", self.processor)

    def _can_compile(self) -> bool:
        import torch

        return bool(
            self.settings.compile
            and self.quantize == "none"
            and self.adapter.native
            and torch.cuda.is_available()
            and str(self.model.device).startswith("cuda")
        )

    # ---- generation -------------------------------------------------------------------------

    def sampling_kwargs(self, params: GenerationParams) -> dict:
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample}
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if params.min_new_tokens:
            kwargs["min_new_tokens"] = params.min_new_tokens
        return kwargs

    def generate(self, items: list[GenerationRequest]) -> list[Generation]:
        """Generate for a batch of items (left-padded together on the native path)."""
        with self.lock:
            if not self.adapter.native:
                return [
                    self.adapter.run(self.model, self.processor, item, self.sampling_kwargs(item.params))
                    for item in items
                ]
            return self._generate_native(items)

    _PADDING_PARAMS = GenerationParams(max_new_tokens=1, temperature=0.0, top_p=1.0, do_sample=False)

    def _generate_native(self, items: list[GenerationRequest]) -> list[Any]:
        """Generations (or a RequestError for an item over the model's context), in item order."""
        import torch

        rows = len(items)
        # On the compiled path the batch is padded to a fixed size, so that a new batch size never
        # triggers a recompilation, with short text-only rows: one token each, then dropped.
        filler = GenerationRequest("chat", [Turn("user", ["."])], self._PADDING_PARAMS)
        padded = items + [filler] * (self.row_bucket(rows) - rows)
        inputs, input_sizes = self.adapter.batch_inputs(self.processor, padded, self.model.device, self.dtype)
        prompt_tokens = inputs["attention_mask"].sum(dim=1).tolist()
        refused = [self._context_error(item, prompt) for item, prompt in zip(items, prompt_tokens)]
        if any(refused):
            fitting = [item for item, error in zip(items, refused) if error is None]
            answers = iter(self._generate_native(fitting) if fitting else [])
            return [error or next(answers) for error in refused]
        with torch.no_grad():
            tokens = self.decode(inputs, [item.params for item in padded])
        results = []
        for row, item in enumerate(items):
            ids = tokens[row][: item.params.max_new_tokens]
            kept = ids[: _trimmed_length(ids, self.eos_ids)]
            results.append(
                Generation(
                    text=self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                    # Grounding reads boxes between special tokens (Qwen's <|box_start|>...).
                    raw_text=self.tokenizer.decode(kept, skip_special_tokens=False)
                    if item.task == "grounding" else None,
                    finish_reason=_finish_reason(ids, self.eos_ids, item.params.max_new_tokens),
                    prompt_tokens=prompt_tokens[row],
                    completion_tokens=len(kept),
                    image_input_size=input_sizes[row],
                )
            )
        return results

    def _context_error(self, item: GenerationRequest, prompt_tokens: int) -> Optional[RequestError]:
        if self.context_length and prompt_tokens + item.params.max_new_tokens > self.context_length:
            return RequestError(
                "context_too_long",
                f"the prompt ({prompt_tokens} tokens, images included) plus max_new_tokens "
                f"({item.params.max_new_tokens}) exceed the model's context of {self.context_length} tokens",
                _join(item.param, "max_new_tokens"),
            )
        return None

    # ---- decoding -----------------------------------------------------------------------------

    ROW_BUCKETS = (1, 4, 16, 64)

    @property
    def row_buckets(self) -> list[int]:
        largest = self.settings.max_batch_size
        return sorted({b for b in self.ROW_BUCKETS if b < largest} | {largest})

    def row_bucket(self, rows: int) -> int:
        if not self.compiled:
            return rows
        return next((b for b in self.row_buckets if b >= rows), rows)

    def cache_length(self, needed: int) -> int:
        """KV-cache length for a batch. Compiled: one length for all batches, doubled (each time
        with a recompilation of every batch size) only by a request longer than any before;
        eager: exactly what is needed."""
        if not self.compiled:
            return needed
        while self._cache_len < needed:
            self._cache_len *= 2
        return self._cache_len

    def decode(self, inputs, params: list[GenerationParams]) -> list[list[int]]:
        rows, prompt_length = inputs["input_ids"].shape
        length = self.cache_length(prompt_length + max(p.max_new_tokens for p in params))
        decoder = self._decoders.get((rows, length))
        if decoder is None:
            self._decoders = {key: d for key, d in self._decoders.items() if key[1] == length}
            decoder = self._decoders[(rows, length)] = Decoder(self, rows, length)
        return decoder.run(inputs, params)

    def decode_forward(self):
        """The model's forward for decoding steps: compiled on the GPU (CUDA graphs are captured
        around it by the Decoder, so inductor's own are off), the plain model elsewhere."""
        if not self.compiled:
            return self.model
        if self._compiled_forward is None:
            import torch

            cache_dir = self.settings.compile_cache_dir
            if cache_dir:  # inductor and Triton read these when they first compile
                os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
                os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
            self._compiled_forward = torch.compile(self.model.__call__, dynamic=False)
        return self._compiled_forward

    def warm_up(self) -> float:
        """Compile and record every batch size at boot, so no request pays for it. Returns seconds."""
        if not self.compiled:
            return 0.0
        from PIL import Image

        started = time.perf_counter()
        image = Image.new("RGB", (448, 448), (127, 127, 127))
        greedy = GenerationParams(max_new_tokens=8, temperature=0.0, top_p=1.0, do_sample=False)
        sampled = dataclasses.replace(greedy, temperature=1.0, do_sample=True)
        for rows in self.row_buckets:
            bucket_started = time.perf_counter()
            # Each variant's first call compiles and records its graph, the second replays it.
            for params in (greedy, greedy, sampled, sampled):
                item = GenerationRequest("caption", [Turn("user", [image, TASK_PROMPTS["caption"]])], params)
                self.generate([item] * rows)
            log.info("warm-up: batch size %d ready in %.1fs", rows, time.perf_counter() - bucket_started)
        seconds = time.perf_counter() - started
        log.info("warmed up batch sizes %s in %.1fs", self.row_buckets, seconds)
        return seconds


_engine: Optional[Engine] = None
_engine_lock = threading.Lock()


def get_engine(quantize: Optional[str] = None) -> Engine:
    """The process's engine, loaded on first use with `quantize` if the caller asked for one."""
    global _engine
    if _engine is None:
        with _engine_lock:
            if _engine is None:
                _engine = Engine(Settings.from_env(), quantize=quantize)
    return _engine


def reset_engine() -> None:
    """Forget the loaded model (tests, and a worker that must reload)."""
    global _engine
    _engine = None


# =================================================================================================
# Tasks
# =================================================================================================

TASK_PROMPTS = {
    "caption": "Describe this image in one sentence.",
    "caption_long": "Describe this image in detail: the scene, the objects, their colours and any text.",
}
TASKS = ("chat", "caption", "caption_long", "vqa", "grounding")


class RequestModel(BaseModel):
    """The fields of one request; messages and images are checked by hand for precise paths."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1.0 is no token count, "yes" no bool

    task: Optional[str] = None
    messages: Optional[Any] = None
    image_url: Optional[Any] = None
    image_b64: Optional[Any] = None
    images: Optional[Any] = None
    question: Optional[str] = None
    target: Optional[str] = None
    model: Optional[str] = None
    quantize: Optional[str] = None
    max_new_tokens: Optional[int] = Field(default=None, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    do_sample: bool = False
    batch_images: Optional[bool] = None

    @field_validator("task")
    @classmethod
    def _known_task(cls, value):
        if value is not None and value not in TASKS:
            raise ValueError(f"unknown task {_quote(value)}; use one of {', '.join(TASKS)}")
        return value

    @field_validator("quantize")
    @classmethod
    def _known_quantize(cls, value):
        if value is not None and value not in QUANTIZE_CHOICES:
            raise ValueError(f"must be one of {', '.join(QUANTIZE_CHOICES)}")
        return value


def _pydantic_error(error: ValidationError, param: Optional[str]) -> RequestError:
    first = error.errors(include_input=False, include_url=False)[0]
    location = ".".join(_cut(str(p)) for p in first["loc"])  # an unknown field's name is the caller's
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    return RequestError("invalid_request", message, _join(param, location) if location else param)


def parse_request(raw: Any, settings: Settings, param: Optional[str] = None) -> tuple[RequestModel, GenerationRequest]:
    """Validate one request dict into its fields and a GenerationRequest (images decoded)."""
    if not isinstance(raw, dict):
        raise RequestError("invalid_request", "must be a JSON object", param or "input")
    check_strings(raw, param)
    try:
        request = RequestModel.model_validate(raw)
    except ValidationError as error:
        raise _pydantic_error(error, param) from None
    task = request.task or ("chat" if request.messages is not None else None)
    if task is None:
        raise RequestError(
            "invalid_request", f"missing; use one of {', '.join(TASKS)} (or send messages)",
            _join(param, "task"),
        )
    # The default never exceeds the cap: a request that sets nothing must not be refused.
    max_new_tokens = request.max_new_tokens or min(settings.default_max_new_tokens, settings.max_new_tokens_cap)
    if max_new_tokens > settings.max_new_tokens_cap:
        raise RequestError(
            "invalid_request",
            f"must be at most {settings.max_new_tokens_cap} on this worker",
            _join(param, "max_new_tokens"),
        )
    if request.do_sample and request.temperature == 0:
        raise RequestError(
            "invalid_request", "must be above 0 when do_sample is true", _join(param, "temperature")
        )
    params = GenerationParams(
        max_new_tokens=max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        do_sample=request.do_sample,
        min_new_tokens=min(request.min_new_tokens, max_new_tokens),
    )
    loose_images = _loose_images(request, param)
    if task == "chat":
        if request.messages is None:
            raise RequestError("invalid_request", "required for the chat task", _join(param, "messages"))
        turns = parse_messages(request.messages, settings, _join(param, "messages"))
        if loose_images:
            first_user = next((t for t in turns if t.role == "user"), None)
            if first_user is None:
                raise RequestError(
                    "invalid_request", "images need a user message to attach to", _join(param, "messages")
                )
            first_user.parts[:0] = loose_images
        prepared = GenerationRequest(task, turns, params, param=param)
    else:
        if request.messages is not None:
            raise RequestError(
                "invalid_request", f"not used by the {task} task; send task 'chat' instead",
                _join(param, "messages"),
            )
        if not loose_images:
            raise RequestError(
                "missing_image", f"the {task} task needs an image (image_url, image_b64 or images)",
                _join(param, "image_url"),
            )
        if task == "vqa":
            text = _required_text(request.question, _join(param, "question"), "the vqa task")
        elif task == "grounding":
            target = _required_text(request.target, _join(param, "target"), "the grounding task")
        else:
            text = TASK_PROMPTS[task]
        # A grounding prompt is the family's own: its adapter adds it (FamilyAdapter.request_turns).
        turn = Turn("user", loose_images if task == "grounding" else [*loose_images, text])
        prepared = GenerationRequest(
            task, [turn], params, grounding_target=target if task == "grounding" else None, param=param
        )
    _check_text_length(prepared, settings, param)
    _resolve_images(prepared.turns, settings, param)
    return request, prepared


MAX_NESTING = 32  # a real request nests 7 levels deep (requests[i].messages[j].content[k].image_url.url)


def check_strings(raw: Any, param: Optional[str]) -> None:
    """Refuse, naming the field, what no tokenizer or URL parser should meet: a lone surrogate
    (invalid Unicode that JSON's \\ud800 escape can carry) or a NUL in any string, keys included,
    and nesting deeper than MAX_NESTING. Iterative: a deep request cannot exhaust the stack."""
    stack: list[tuple[Any, Optional[str], Any, int]] = [(raw, None, None, 0)]  # value, parent, key, depth
    while stack:
        value, parent, key, depth = stack.pop()
        if not isinstance(value, (str, dict, list)):
            continue
        where = param if depth == 0 else _field_path(parent, key)
        if isinstance(value, str):
            _check_text(value, where, "value")
        elif depth >= MAX_NESTING:
            raise RequestError("invalid_request", f"nested deeper than {MAX_NESTING} levels", where or "input")
        elif isinstance(value, list):
            stack.extend((value[i], where, i, depth + 1) for i in reversed(range(len(value))))
        else:
            for name in value:
                if isinstance(name, str):
                    _check_text(name, _field_path(where, name), "field name")
            stack.extend((value[name], where, name, depth + 1) for name in reversed(value))


def _field_path(parent: Optional[str], key: Any) -> str:
    if isinstance(key, int):
        return f"{parent or ''}[{key}]"
    return _join(parent, _cut(key if isinstance(key, str) else repr(key)))


def _check_text(text: str, where: Optional[str], what: str) -> None:
    if "\x00" in text:
        raise RequestError("invalid_request", f"the {what} holds a NUL character", where or "input")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(
                "invalid_request", f"the {what} holds invalid Unicode (a lone surrogate)", where or "input"
            ) from None


def _required_text(value: Optional[str], param: str, what: str) -> str:
    if value is None or not value.strip():
        raise RequestError("invalid_request", f"required for {what}", param)
    return value.strip()


def _loose_images(request: RequestModel, param: Optional[str]) -> list["ImageSpec"]:
    """Images given beside the prompt: image_url, image_b64 and images[...], in that order."""
    specs: list[ImageSpec] = []
    if request.image_url is not None:
        specs.append(ImageSpec(request.image_url, _join(param, "image_url")))
    if request.image_b64 is not None:
        specs.append(ImageSpec(request.image_b64, _join(param, "image_b64")))
    if request.images is not None:
        if not isinstance(request.images, list):
            raise RequestError("invalid_request", "must be a list of images", _join(param, "images"))
        specs.extend(ImageSpec(spec, _join(param, f"images[{i}]")) for i, spec in enumerate(request.images))
    return specs


def parse_messages(messages: Any, settings: Settings, param: str) -> list[Turn]:
    """OpenAI-style messages -> turns; images of every accepted block shape are left as ImageSpec,
    for `_resolve_images` to fetch under the request's limits."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("invalid_request", "must be a non-empty list of messages", param)
    if len(messages) > settings.max_messages:
        raise RequestError(
            "invalid_request", f"at most {settings.max_messages} messages per request", param
        )
    turns = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise RequestError("invalid_request", "must be an object with role and content", where)
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise RequestError(
                "invalid_request", "must be system, user or assistant", f"{where}.role"
            )
        content = message.get("content")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list) and content:
            parts = [_parse_block(block, f"{where}.content[{j}]") for j, block in enumerate(content)]
        else:
            raise RequestError(
                "invalid_request", "must be a string or a non-empty list of blocks", f"{where}.content"
            )
        if role != "user" and any(not isinstance(p, str) for p in parts):
            raise RequestError("invalid_request", "images are allowed in user messages only", f"{where}.content")
        turns.append(Turn(role, parts))
    if turns[-1].role != "user":
        raise RequestError("invalid_request", "the last message must come from the user", f"{param}[{len(turns) - 1}].role")
    return turns


def _parse_block(block: Any, where: str):
    if not isinstance(block, dict):
        raise RequestError("invalid_request", "a content block must be an object with a type", where)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise RequestError("invalid_request", "a text block needs a string 'text'", f"{where}.text")
        return text
    if kind == "image_url":
        if "image_url" not in block:
            raise RequestError("invalid_request", "an image_url block needs 'image_url'", f"{where}.image_url")
        return ImageSpec(block["image_url"], f"{where}.image_url")
    if kind == "image":
        if "image" not in block:
            raise RequestError("invalid_request", "an image block needs 'image'", f"{where}.image")
        return ImageSpec(block["image"], f"{where}.image")
    raise RequestError("invalid_request", "type must be text, image_url or image", f"{where}.type")


def _check_text_length(item: GenerationRequest, settings: Settings, param: Optional[str]) -> None:
    text = sum(len(p) for t in item.turns for p in t.parts if isinstance(p, str))
    text += len(item.grounding_target or "")  # becomes part of the prompt when the batch runs
    if text > settings.max_text_chars:
        raise RequestError(
            "text_too_long", f"the request's text is over {settings.max_text_chars} characters", param or "input"
        )


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """An image named by a request and not yet fetched or decoded; `param` is where it was given."""

    spec: Any
    param: str


MAX_PARALLEL_FETCHES = 8  # threads fetching the images of one request


def _resolve_images(turns: list[Turn], settings: Settings, param: Optional[str]) -> None:
    """Fetch and decode a request's images in place, in order, under its limits: the count is
    checked before anything is fetched, all fetches share one deadline (VLM_FETCH_DEADLINE), and
    the pixel budget is checked from each image's header before it is decoded."""
    pending = [(turn, k) for turn in turns for k, part in enumerate(turn.parts) if isinstance(part, ImageSpec)]
    if len(pending) > settings.max_images:
        turn, k = pending[settings.max_images]
        raise RequestError(
            "too_many_images", f"at most {settings.max_images} images per request", turn.parts[k].param
        )
    policy, used = MediaPolicy.from_env(), 0
    sources = [image_source(turn.parts[k].spec, turn.parts[k].param) for turn, k in pending]
    fetched = _fetch_all(sources, policy)
    try:  # each image is decoded as soon as it and those before it have arrived
        for (turn, k), (data, where) in zip(pending, fetched):
            remaining = settings.max_total_pixels - used
            narrowed = remaining < policy.max_image_pixels
            try:
                image = _decode_image(
                    data, dataclasses.replace(policy, max_image_pixels=max(remaining, 1)) if narrowed else policy,
                    where,
                )
            except RequestError as error:
                if narrowed and error.code == "image_too_large":
                    raise RequestError(
                        "image_too_large",
                        f"the request's images hold over {settings.max_total_pixels} pixels together",
                        turn.parts[k].param,
                    ) from None
                raise
            used += image.width * image.height
            turn.parts[k] = image
    finally:
        fetched.close()  # drops the fetches not yet started


def _fetch_all(sources: list[tuple[str, str]], policy: MediaPolicy) -> Iterable[tuple[bytes, str]]:
    """(bytes, field) of each (text, field), in order. URLs download side by side, at most
    MAX_PARALLEL_FETCHES at once, all under one request-wide deadline; the first failure in order
    is raised and the fetches not yet started are dropped."""
    deadline = time.monotonic() + policy.fetch_deadline
    if len(sources) == 1 or sum(1 for text, _ in sources if _is_url(text)) <= 1:
        for text, where in sources:  # nothing to overlap: no threads
            yield _image_bytes(text, policy, where, deadline), where
        return
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(min(MAX_PARALLEL_FETCHES, len(sources)), thread_name_prefix="vlm-fetch")
    try:
        futures = [pool.submit(_image_bytes, text, policy, where, deadline) for text, where in sources]
        for future, (_, where) in zip(futures, sources):
            try:  # each fetch stops itself at the deadline; the margin only guards against a stuck thread
                data = future.result(timeout=max(deadline - time.monotonic(), 0) + 2)
            except concurrent.futures.TimeoutError:
                raise RequestError(
                    "fetch_timeout", f"the request's images took over {policy.fetch_deadline:g}s to download", where
                ) from None
            yield data, where
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _is_url(text: str) -> bool:
    scheme = _URL_SCHEME.match(text)
    return bool(scheme) and scheme.group(1).lower() in ("http", "https")


# ---- parsing boxes ------------------------------------------------------------------------------

_NUMBER = r"-?\d+(?:\.\d+)?"
_BOX_PATTERNS = (
    # {"bbox": [...]} / {"bbox_2d": [...]}
    re.compile(rf'"bbox(?:_2d)?"\s*:\s*\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]'),
    # (x1,y1),(x2,y2), with or without Qwen's <|box_start|> tokens
    re.compile(rf"\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)\s*,?\s*\(\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\)"),
    # [x1, y1, x2, y2]
    re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]"),
    # a plain quartet of numbers
    re.compile(rf"({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})"),
)


def parse_bbox(text: str) -> Optional[list[float]]:
    """The first box in a model's answer, as [x1, y1, x2, y2] in the model's own coordinates."""
    for pattern in _BOX_PATTERNS:
        match = pattern.search(text or "")
        if match:
            x1, y1, x2, y2 = (float(v) for v in match.groups())
            return [min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)]
    return None


def box_to_pixels(box: list[float], system: Optional[str], size: tuple[int, int],
                  input_size: Optional[tuple[int, int]] = None) -> list[int]:
    """Scale a box from the model's coordinate system to the original image's pixels, clamped."""
    width, height = size
    if system == "qwen-1000":
        sx, sy = width / 1000, height / 1000
    elif system == "qwen-abs-pixels" and input_size:
        sx, sy = width / input_size[0], height / input_size[1]
    elif max(box) <= 1.0:
        sx, sy = width, height
    else:
        sx = sy = 1.0
    x1, y1, x2, y2 = box
    return [
        int(round(min(max(x1 * sx, 0), width))), int(round(min(max(y1 * sy, 0), height))),
        int(round(min(max(x2 * sx, 0), width))), int(round(min(max(y2 * sy, 0), height))),
    ]


def grounding_fields(item: GenerationRequest, generation: Generation, adapter: FamilyAdapter) -> dict:
    fields: dict = {"bbox": None, "supports_grounding": adapter.grounding is not None}
    if adapter.grounding is None:
        fields["bbox_warning"] = f"the {adapter.name} family has no grounding output; see response"
        return fields
    box = parse_bbox(generation.raw_text or generation.text)
    if box is None:
        fields["bbox_warning"] = "no bounding box found in the model's answer"
        return fields
    image = item.images[0]
    fields["bbox"] = box_to_pixels(box, adapter.grounding, image.size, generation.image_input_size)
    return fields


# =================================================================================================
# Batching
# =================================================================================================


def generate_all(engine: Engine, items: list[GenerationRequest]) -> list[Any]:
    """Run prepared items as padded batches; results in input order.

    Greedy and sampled items share batches (sampling is chosen per row). Items are batched by
    similar max_new_tokens, so a short answer rarely waits for a long one. A batch that fails is
    retried item by item, so one bad item never sinks its neighbours."""
    results: list[Any] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda i: items[i].params.max_new_tokens)
    # Remote-code families answer one item per call anyway: batching them would only make a
    # failure redo the items before it.
    size = engine.settings.max_batch_size if engine.adapter.native else 1
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        if len(chunk) == 1:
            generations = [generate_alone(engine, items[chunk[0]])]
        else:
            try:
                generations = engine.generate([items[i] for i in chunk])
            except Exception:
                log.warning("a batch of %d failed; answering its items one by one", len(chunk), exc_info=True)
                generations = [generate_alone(engine, items[i]) for i in chunk]
        for i, generation in zip(chunk, generations):
            results[i] = generation
    return results


def generate_alone(engine: Engine, item: GenerationRequest):
    try:
        return engine.generate([item])[0]
    except RequestError as error:
        return error
    except Exception:
        log.exception("generation failed")
        return RequestError("generation_failed", "the model could not answer this request", item.param)


def format_output(engine: Engine, item: GenerationRequest, generation: Generation, request: RequestModel) -> dict:
    output = {
        "response": generation.text,
        "model": engine.model_id,
        "task": item.task,
        "image_count": len(item.images),
        "finish_reason": generation.finish_reason,
        "usage": {
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
        },
    }
    if item.task == "grounding":
        output.update(grounding_fields(item, generation, engine.adapter))
    if request.batch_images is not None:
        output["batch_images"] = request.batch_images
    if request.quantize is not None and request.quantize != engine.quantize:
        output["quantize"] = engine.quantize
        output["quantize_warning"] = (
            f"the model was loaded as {engine.quantize!r}; the requested {request.quantize!r} "
            "applies only when a request loads the model"
        )
    return output


def _check_model(request: RequestModel, model_id: str, param: Optional[str]) -> None:
    if request.model is not None and request.model != model_id:
        raise RequestError(
            "model_mismatch",
            f"this worker serves {model_id}; it cannot switch to {request.model!r}",
            _join(param, "model"),
        )


# =================================================================================================
# Entry point
# =================================================================================================


def handler(job: dict) -> dict:
    """RunPod entry: one request, or {"requests": [...]} answered item by item."""
    try:
        payload = job.get("input") if isinstance(job, dict) else None
        if not isinstance(payload, dict):
            raise RequestError("invalid_request", "the job needs an 'input' object", "input")
        if "requests" in payload:
            return _handle_batch(job, payload)
        return _handle_single(payload)
    except RequestError as error:
        return error.to_dict()
    except SettingsError as error:
        log.error("settings: %s", error)
        return {"error": f"worker misconfigured: {error}", "code": "worker_misconfigured", "param": None}
    except Exception:
        log.exception("unexpected failure")
        return {"error": "internal error while answering this request", "code": "internal_error", "param": None}


def served_model() -> tuple[Settings, str]:
    """The settings and model id in force: the loaded engine's, else the environment's."""
    if _engine is not None:
        return _engine.settings, _engine.model_id
    settings = Settings.from_env()
    return settings, settings.model


def read_request(raw: Any, settings: Settings, model_id: str, param: Optional[str]) -> tuple[RequestModel, GenerationRequest]:
    request, item = parse_request(raw, settings, param)
    _check_model(request, model_id, param)
    return request, item


def answer_requests(parsed: list[tuple[RequestModel, GenerationRequest]]) -> list[dict]:
    """Outputs (or error dicts) for validated requests; the first request to ask for a
    quantization decides it if this call loads the model."""
    engine = get_engine(next((request.quantize for request, _ in parsed if request.quantize), None))
    generations = generate_all(engine, [item for _, item in parsed])
    return [
        generation.to_dict() if isinstance(generation, RequestError)
        else format_output(engine, item, generation, request)
        for (request, item), generation in zip(parsed, generations)
    ]


def _handle_single(payload: dict) -> dict:
    settings, model_id = served_model()
    return answer_requests([read_request(payload, settings, model_id, None)])[0]


def _handle_batch(job: dict, payload: dict) -> dict:
    extra = set(payload) - {"requests"}
    if extra:
        raise RequestError("invalid_request", "unknown field beside 'requests'", sorted(extra)[0])
    raw_items = payload["requests"]
    settings, model_id = served_model()
    if not isinstance(raw_items, list) or not raw_items:
        raise RequestError("invalid_request", "must be a non-empty list of requests", "requests")
    if len(raw_items) > settings.max_batch_requests:
        raise RequestError(
            "too_many_requests", f"at most {settings.max_batch_requests} requests per call", "requests"
        )

    def read_item(index: int, raw: Any):
        param = f"requests[{index}]"
        try:
            return read_request(raw, settings, model_id, param)
        except (RequestError, SettingsError) as error:
            return error
        except Exception:
            log.exception("could not read %s", param)
            return RequestError("internal_error", "this request could not be read", param)

    # Items are read side by side: their images download and decode in parallel (Pillow's
    # decoders release the GIL).
    with ThreadPoolExecutor(max_workers=min(8, len(raw_items))) as pool:
        outcomes = list(pool.map(read_item, range(len(raw_items)), raw_items))
    for outcome in outcomes:
        if isinstance(outcome, SettingsError):
            raise outcome
    results = [outcome.to_dict() if isinstance(outcome, RequestError) else None for outcome in outcomes]
    readable = [index for index, outcome in enumerate(outcomes) if not isinstance(outcome, RequestError)]
    if readable:
        for index, answer in zip(readable, answer_requests([outcomes[i] for i in readable])):
            results[index] = answer
    return {"model": model_id, "count": len(results), "id": job.get("id"), "results": results}


def main() -> None:
    os.environ.setdefault("RUNPOD_LOG_LEVEL", "INFO")  # the SDK's DEBUG default logs every answer
    import runpod

    logging.basicConfig(level=os.environ.get("VLM_LOG_LEVEL", "INFO"))
    get_engine().warm_up()  # load and compile before taking jobs: the first user pays neither
    runpod.serverless.start({"handler": handler})


if __name__ == "__main__":
    main()
