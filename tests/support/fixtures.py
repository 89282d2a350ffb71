"""The stubbed suite's fixtures (bound by test_handler.py): the fakes in sys.modules, a fresh hub per test, no network;
and what the fakes received."""

from __future__ import annotations

import io
import os
import sys
import urllib.error
import urllib.request

import pytest

import handler
import runpod_vlm.engine.background_compile as background_compile
import runpod_vlm.engine.engine as engine_module
import runpod_vlm.engine.memory as memory_module
from runpod_vlm import fetch, media
from runpod_vlm.vocabulary import RequestError
from support.fake_decoder import FakePagedDecoder
from support.fake_hub import HUB, build_stub_modules
from support.stubbed_api import MISSING, STUBBED_API, USED

# =================================================================================================
# Fixtures (bound by test_handler.py): the fakes in sys.modules, a fresh hub, no network
# =================================================================================================


@pytest.fixture(scope="module", autouse=True)
def stub_modules():
    """Install the stubs for this module only; sys.modules is restored afterwards."""
    patch = pytest.MonkeyPatch()
    modules = build_stub_modules()
    for name, module in modules.items():
        patch.setitem(sys.modules, name, module)
    handler.reset_engine()
    try:
        yield modules
    finally:
        handler.reset_engine()
        patch.undo()


class UnusedGrammars:
    """The engine's grammar builder, made at boot; no stubbed test asks for structured output."""

    def __init__(self, tokenizer, vocab_size, end_token, deadline_s):
        pass

    def start(self, schema, param, limit=None):
        raise AssertionError("structured output is tested on real tiny models")

    def close(self):
        pass


@pytest.fixture(autouse=True)
def hub(monkeypatch):
    """A fresh scripted hub and no VLM_ setting per test; afterwards the handler must have used only
    stubbed, listed API and kept to the protocol the fakes check (devices, padding, KV cache)."""
    for key in list(os.environ):
        if key.startswith("VLM_"):
            monkeypatch.delenv(key)
    HUB.reset()
    MISSING.clear()
    handler.reset_engine()
    monkeypatch.setattr(engine_module, "PagedDecoder", FakePagedDecoder)
    monkeypatch.setattr(engine_module, "use_paged_attention", lambda model: HUB.paged_attention)
    # Grammars (llguidance over a real tokenizer) run for real in tests/test_structured_output.py.
    monkeypatch.setattr(engine_module, "Grammars", UnusedGrammars)
    # The vision tower's attention runs for real in tests/test_vision_attention.py.
    monkeypatch.setattr(engine_module, "use_packed_vision_attention", lambda model: True)
    # GPU memory is asked of the fake torch.cuda; the work memory is measured on the GPU (bench/harness.py).
    monkeypatch.setattr(
        memory_module, "measured_work_memory", lambda model, settings, dtype, graph_tokens=0: HUB.work_memory
    )
    monkeypatch.setattr(memory_module, "kv_bytes_per_token", lambda model: HUB.kv_bytes_per_token)
    # The compile-artifact file is torch's (tests/test_compile_cache.py runs it for real): here the
    # engine's use of it is recorded.
    monkeypatch.setattr(
        background_compile, "compile_cache_key", lambda model_id, **parts: f"{model_id}:{parts['shapes']}"
    )
    monkeypatch.setattr(
        background_compile, "load_compile_artifacts", lambda s, key: HUB.artifacts.append(("load", key)) or False
    )
    monkeypatch.setattr(
        background_compile, "save_compile_artifacts", lambda settings, key: HUB.artifacts.append(("save", key))
    )
    yield HUB
    handler.reset_engine()
    assert not MISSING, f"the handler used torch/transformers API the stubs lack: {sorted(MISSING)}"
    assert not HUB.protocol_errors, HUB.protocol_errors
    assert USED <= STUBBED_API, f"recorded but not listed in STUBBED_API: {sorted(USED - STUBBED_API)}"


WEB: dict = {}


@pytest.fixture(autouse=True)
def web(monkeypatch):
    """No test touches the network: URL fetches are answered from WEB (url -> bytes)."""
    WEB.clear()
    fetched = []

    def serve_url(url):
        fetched.append(url)
        if url not in WEB:
            raise urllib.error.URLError("unreachable (fake web)")
        return WEB[url]

    def fake_fetch(url, policy=None, param=None, *args, **kwargs):
        if policy is not None:
            fetch.check_image_url(url, policy, param)  # the policy still decides what may be fetched
        try:
            return serve_url(url)
        except urllib.error.URLError:
            raise RequestError("fetch_failed", "the image URL could not be fetched", param) from None

    monkeypatch.setattr(media, "fetch_image_url", fake_fetch)

    class FakeResponse(io.BytesIO):
        status = code = 200

        def __init__(self, data, url):
            super().__init__(data)
            self.url = url
            self.headers = {"Content-Type": "image/png", "Content-Length": str(len(data))}

        def getheader(self, name, default=None):
            return self.headers.get(name, default)

        def info(self):
            return self.headers

        def geturl(self):
            return self.url

        def getcode(self):
            return 200

    def fake_urlopen(request, *args, **kwargs):
        url = getattr(request, "full_url", request)
        return FakeResponse(serve_url(url), url)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setattr(urllib.request.OpenerDirector, "open", lambda self, req, *a, **k: fake_urlopen(req))
    return fetched


# =================================================================================================
# What the fakes received
# =================================================================================================


def sent_images(call_index=-1) -> list:
    """The images the native processor received in one call, flattened, in order."""
    images = HUB.processor_calls[call_index]["images"] or []
    flat = []
    for entry in images:
        flat.extend(entry if isinstance(entry, list) else [entry])
    return flat


def model_load():
    """(api, path, kwargs) of the call that loaded the model weights."""
    loads = [entry for entry in HUB.loads if entry[0].startswith("AutoModel")]
    assert len(loads) == 1, HUB.loads
    return loads[0]
