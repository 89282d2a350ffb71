"""Cold start: the compile-artifact cache (key, folders, damaged files, concurrent writers,
read-only volumes, one real round trip through torch's mega-cache) and RunPod's cached models.

Real torch on CPU throughout. `torch.compiler.load_cache_artifacts` / `save_cache_artifacts` are
replaced by recorders only where a test is about which file reaches torch or chooses the payload;
damaged files go to the real loader, with real artifacts that a fresh process compiled and saved.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import handler
import runpod_vlm.engine.background_compile as background_compile
import runpod_vlm.engine.compile as compile_module
from runpod_vlm.engine.compile import (
    COMPILE_ARTIFACTS_SUFFIX,
    compile_artifact_dirs,
    compile_cache_key,
    decoder_layers,
    load_compile_artifacts,
    model_view,
    runtime_fingerprint,
    save_compile_artifacts,
    set_torch_cache_dirs,
)
from runpod_vlm.engine.decoder import PagedDecoder, row_buckets
from runpod_vlm.engine.loading import missing_model_files, weights_source
from runpod_vlm.engine.projections import share_weights
from runpod_vlm.settings import Settings
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, Turn

ROOT = Path(__file__).resolve().parents[1]

RUNTIME = {
    "python": "3.12.3",
    "torch": torch.__version__,
    "transformers": "5.17.0",
    "triton": "3.6.0",
    "cuda": "13.0",
    "gpu": "NVIDIA H200",
    "capability": "9.0",
}
KEY_INPUTS = dict(
    config={"model_type": "qwen2_vl", "text_config": {"hidden_size": 1536, "num_hidden_layers": 28}},
    revision="895c3a49bc3fa70a340399125c650a463535e71c",
    dtype="torch.bfloat16",
    shapes={"rows": {1, 4, 16}, "cache_len": 2048},
    runtime=RUNTIME,
)


def key_of(model_id: str = "Qwen/Qwen2-VL-2B-Instruct", **changes) -> str:
    return compile_cache_key(model_id, **{**KEY_INPUTS, **changes})


@pytest.fixture(autouse=True)
def torch_cache_variables(monkeypatch):
    """Loading sets TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR: start without them, and restore
    them afterwards, so no test leaves this process's compilations pointed into its tmp_path."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """A fake network volume and container; `env` as the worker would see it on RunPod."""
    volume = tmp_path / "runpod-volume"
    volume.mkdir()
    monkeypatch.setattr(compile_module, "RUNPOD_VOLUME", str(volume))
    monkeypatch.setattr(compile_module, "_reported_unwritable", set())
    env = {"HF_HOME": str(tmp_path / "hf")}
    return {
        "env": env,
        "settings": Settings.from_env(env),
        "volume": volume / "vlm-compile-cache",
        "container": tmp_path / "hf" / "compile-cache",
    }


@pytest.fixture
def torch_loads(monkeypatch):
    """Records every payload handed to torch.compiler.load_cache_artifacts; refuses (None, as torch
    does) a payload starting with b"bad"."""
    payloads = []

    class Info:
        artifacts = {"inductor": ["a", "b"], "triton": ["c"]}

    def load(payload):
        payloads.append(payload)
        return None if payload.startswith(b"bad") else Info()

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return payloads


@pytest.fixture
def torch_saves(monkeypatch):
    """torch.compiler.save_cache_artifacts returning the payload a test puts in the list."""
    payload = [os.urandom(30_000)]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload[0], None))
    return payload


def compile_cache_records(caplog):
    return [r for r in caplog.records if r.name == "runpod-vlm" and r.getMessage().startswith("compile cache")]


# ---- key ----------------------------------------------------------------------------------------


def test_key_is_stable_and_changes_with_every_input():
    base = key_of()
    assert key_of() == base
    # Sets are compared as sets: the order the engine lists its batch sizes in does not matter.
    assert key_of(shapes={"cache_len": 2048, "rows": {16, 4, 1}}) == base
    variants = {
        "model": key_of("Qwen/Qwen2-VL-7B-Instruct"),
        "config": key_of(config={"model_type": "qwen2_vl", "text_config": {"num_hidden_layers": 27}}),
        "revision": key_of(revision="0" * 40),
        "dtype": key_of(dtype="torch.float16"),
        "shapes": key_of(shapes={"rows": {1, 4, 16, 64}, "cache_len": 2048}),
        "cache length": key_of(shapes={"rows": {1, 4, 16}, "cache_len": 4096}),
    }
    for field in RUNTIME:
        variants[field] = key_of(runtime={**RUNTIME, field: "other"})
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants), variants
    for key in [base, *variants.values()]:
        assert os.path.basename(key) == key and not key.startswith(".")


def test_key_reads_a_transformers_config_and_this_process_runtime():
    from transformers import Qwen2VLConfig

    small, large = Qwen2VLConfig(), Qwen2VLConfig(text_config={"num_hidden_layers": 3})
    assert compile_cache_key("m", config=small) == compile_cache_key("m", config=Qwen2VLConfig())
    assert compile_cache_key("m", config=small) != compile_cache_key("m", config=large)
    runtime = runtime_fingerprint()
    assert runtime["torch"] == torch.__version__ and runtime["gpu"] == "cpu"
    assert compile_cache_key("m") == compile_cache_key("m", runtime=runtime)


# ---- folders ------------------------------------------------------------------------------------


def test_folders_prefer_the_network_volume_then_the_container(folders, tmp_path, monkeypatch):
    env, settings = folders["env"], folders["settings"]
    assert compile_artifact_dirs(settings, env) == [str(folders["volume"]), str(folders["container"])]

    explicit = {**env, "VLM_COMPILE_CACHE_DIR": str(tmp_path / "mine")}
    assert compile_artifact_dirs(Settings.from_env(explicit), explicit) == [
        str(tmp_path / "mine"),
        str(folders["container"]),
    ]

    monkeypatch.setattr(compile_module, "RUNPOD_VOLUME", str(tmp_path / "no-volume-here"))
    assert compile_artifact_dirs(settings, env) == [str(folders["container"])]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_artifact_dirs(Settings.from_env({}), {}) == [
        str(tmp_path / "home" / ".cache" / "runpod-vlm" / "compile-cache")
    ]


def test_torch_caches_follow_the_setting_and_leave_an_unwritable_one(folders, tmp_path, monkeypatch, caplog):
    set_torch_cache_dirs(folders["settings"], folders["env"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folders["container"] / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folders["container"] / "triton")

    # Tests run as root, which chmod cannot stop: a file stands where the folder should be.
    (tmp_path / "a-file").write_text("")
    env = {**folders["env"], "VLM_COMPILE_CACHE_DIR": str(tmp_path / "a-file" / "cache")}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        set_torch_cache_dirs(Settings.from_env(env), env)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folders["container"] / "inductor")
    assert [r.levelno for r in compile_cache_records(caplog)] == [logging.WARNING]

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")  # an operator's own choice stays
    set_torch_cache_dirs(folders["settings"], folders["env"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"


# ---- real artifacts, and a fresh process compiling from them -----------------------------------

ROUND_TRIP = """
import json, sys
import torch
from torch._dynamo.utils import counters
from runpod_vlm.engine.compile import compile_cache_key, load_compile_artifacts, save_compile_artifacts
from runpod_vlm.settings import Settings

settings = Settings.from_env()
key = compile_cache_key("tiny/matmul", dtype=torch.float32, shapes=[[8, 8]])
loaded = load_compile_artifacts(settings, key)
square = torch.compile(lambda a: a @ a.T)  # an extern matmul: no C++ kernel to build, so quick
square(torch.ones(8, 8))
saved = save_compile_artifacts(settings, key) if sys.argv[1] == "save" else None
print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def run_round_trip(root: Path, step: str) -> dict:
    env = {
        **os.environ,
        "VLM_COMPILE_CACHE_DIR": str(root / "artifacts"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / step / "inductor"),
        "TRITON_CACHE_DIR": str(root / step / "triton"),
        "HF_HOME": str(root / step / "hf"),
    }
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, step], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_by_a_process(tmp_path_factory):
    """A fresh process compiled (an inductor cache miss) and saved its artifacts: (root, its result)."""
    root = tmp_path_factory.mktemp("round-trip")
    return root, run_round_trip(root, "save")


def test_a_fresh_process_compiles_from_the_artifacts_another_saved(saved_by_a_process):
    """Process 2, with empty inductor and Triton caches of its own, loads the file process 1 saved
    and finds the compiled graph in them (a hit, no miss)."""
    root, first = saved_by_a_process
    assert first["loaded"] is False and first["misses"] >= 1 and first["hits"] == 0
    assert first["saved"] and Path(first["saved"]).parent == root / "artifacts"
    second = run_round_trip(root, "load")
    assert second["loaded"] is True and second["hits"] >= 1 and second["misses"] == 0


def _damage(data: bytes, how: str) -> bytes:
    if how == "flipped byte":
        return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]
    return {"truncated": data[:-10], "empty": b"", "garbage": os.urandom(len(data)), "appended to": data + b"more"}[how]


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "appended to", "flipped byte"])
def test_a_damaged_file_is_one_line_and_compiling_from_scratch(saved_by_a_process, folders, caplog, how):
    """torch checks its bundle's own checksum: the real loader refuses every damaged copy."""
    real = Path(saved_by_a_process[1]["saved"]).read_bytes()
    key = key_of()
    folders["volume"].mkdir()
    path = folders["volume"] / (key + COMPILE_ARTIFACTS_SUFFIX)
    path.write_bytes(_damage(real, how))
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    [record] = compile_cache_records(caplog)
    assert record.levelno == logging.WARNING and str(path) in record.getMessage()


# ---- loading: which file reaches torch ----------------------------------------------------------


def test_a_saved_file_loads_and_reaches_torch_whole(folders, torch_saves, torch_loads, caplog):
    key = key_of()
    save_compile_artifacts(folders["settings"], key, folders["env"])
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == torch_saves
    [record] = compile_cache_records(caplog)
    assert record.levelno == logging.INFO and "loaded" in record.getMessage()


def test_no_file_is_one_line_and_no_torch_call(folders, torch_loads, caplog):
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key_of(), folders["env"]) is False
    assert torch_loads == []
    [record] = compile_cache_records(caplog)
    assert "no artifacts" in record.getMessage()


def test_another_setups_file_is_never_opened(folders, torch_saves, torch_loads, caplog):
    """The key is the file name: artifacts of another dtype, or another torch, are simply not found."""
    save_compile_artifacts(folders["settings"], key_of(dtype="torch.float16"), folders["env"])
    save_compile_artifacts(folders["settings"], key_of(runtime={**RUNTIME, "torch": "2.8.0"}), folders["env"])
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key_of(), folders["env"]) is False
    assert torch_loads == []
    assert "no artifacts" in compile_cache_records(caplog)[-1].getMessage()


def test_torch_refusing_or_raising_is_one_line_not_a_crash(folders, torch_saves, monkeypatch, caplog):
    def refuse(payload):
        raise RuntimeError("unpickling failed")

    key = key_of()
    save_compile_artifacts(folders["settings"], key, folders["env"])
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuse)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    [record] = compile_cache_records(caplog)
    assert "unpickling failed" in record.getMessage()


def test_a_bad_volume_file_falls_back_to_the_container_copy(folders, torch_loads, caplog):
    key, name = key_of(), key_of() + COMPILE_ARTIFACTS_SUFFIX
    for folder, payload in [(folders["volume"], b"bad" * 100), (folders["container"], b"good" * 100)]:
        folder.mkdir(parents=True)
        (folder / name).write_bytes(payload)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == [b"bad" * 100, b"good" * 100]
    assert [r.levelno for r in compile_cache_records(caplog)] == [logging.WARNING, logging.INFO]


# ---- saving -------------------------------------------------------------------------------------


def test_save_writes_the_volume_and_replaces_older_artifacts(folders, torch_saves):
    key = key_of()
    path = save_compile_artifacts(folders["settings"], key, folders["env"])
    assert path == str(folders["volume"] / (key + COMPILE_ARTIFACTS_SUFFIX))
    assert Path(path).read_bytes() == torch_saves[0]
    torch_saves[0] = os.urandom(30_000)
    assert save_compile_artifacts(folders["settings"], key, folders["env"]) == path
    assert Path(path).read_bytes() == torch_saves[0]  # new artifacts replace them
    assert [n for n in os.listdir(folders["volume"]) if n.endswith(".tmp")] == []


def test_save_with_nothing_compiled_or_a_torch_error_writes_nothing(folders, monkeypatch, caplog):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert save_compile_artifacts(folders["settings"], key_of(), folders["env"]) is None
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: 1 / 0)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert save_compile_artifacts(folders["settings"], key_of(), folders["env"]) is None
    assert "ZeroDivisionError" in compile_cache_records(caplog)[-1].getMessage()
    assert not folders["volume"].exists() and not folders["container"].exists()


def refuse_new_files(monkeypatch, folder: Path) -> None:
    """Make creating any file in `folder` fail as on a read-only file system (reading still works)."""
    real_open = os.open

    def read_only_open(path, flags, *args, **kwargs):
        target = Path(os.fsdecode(path))
        if flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)) and folder in (target, target.parent):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)


def test_an_unwritable_volume_falls_back_to_the_container_with_one_line(folders, torch_saves, caplog, monkeypatch):
    # A read-only file system refuses to create files (root included): creating one in the volume
    # raises EROFS, as it would there. The volume's folder exists and is readable.
    folders["volume"].mkdir()
    refuse_new_files(monkeypatch, folders["volume"])
    key = key_of()
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        first = save_compile_artifacts(folders["settings"], key, folders["env"])
        torch_saves[0] = os.urandom(30_000)
        second = save_compile_artifacts(folders["settings"], key, folders["env"])
    assert first == second == str(folders["container"] / (key + COMPILE_ARTIFACTS_SUFFIX))
    assert Path(second).read_bytes() == torch_saves[0]
    warnings = [r for r in compile_cache_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(folders["volume"]) in warnings[0].getMessage()
    assert os.listdir(folders["volume"]) == []


def test_a_file_where_the_folder_should_be_falls_back_too(folders, torch_saves, tmp_path):
    (tmp_path / "a-file").write_text("")
    env = {**folders["env"], "VLM_COMPILE_CACHE_DIR": str(tmp_path / "a-file" / "cache")}
    path = save_compile_artifacts(Settings.from_env(env), key_of(), env)
    assert path == str(folders["container"] / (key_of() + COMPILE_ARTIFACTS_SUFFIX))


def test_nowhere_writable_saves_nothing_and_does_not_raise(folders, torch_saves, tmp_path):
    folders["volume"].write_text("")  # files where both folders should be
    (tmp_path / "hf").write_text("")
    assert save_compile_artifacts(folders["settings"], key_of(), folders["env"]) is None


def test_a_read_only_volume_still_serves_its_artifacts(folders, torch_saves, torch_loads, monkeypatch):
    key = key_of()
    save_compile_artifacts(folders["settings"], key, folders["env"])
    refuse_new_files(monkeypatch, folders["volume"])
    assert load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == torch_saves


# ---- concurrent writers -------------------------------------------------------------------------


def _artifact_files(folder: Path) -> tuple[list[str], list[str]]:
    names = os.listdir(folder)
    return [n for n in names if n.endswith(COMPILE_ARTIFACTS_SUFFIX)], [n for n in names if n.endswith(".tmp")]


def test_concurrent_writers_leave_one_whole_file_and_readers_never_see_a_part(tmp_path, monkeypatch):
    env = {"VLM_COMPILE_CACHE_DIR": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    settings, key = Settings.from_env(env), key_of()
    payloads = [bytes([n]) * 400_000 for n in range(8)]
    # Each writer thread saves its own payload: thread n's name is "n".
    monkeypatch.setattr(
        torch.compiler, "save_cache_artifacts", lambda: (payloads[int(threading.current_thread().name)], None)
    )
    path = tmp_path / "cache" / (key + COMPILE_ARTIFACTS_SUFFIX)
    seen = []

    def write():
        for _ in range(5):
            assert save_compile_artifacts(settings, key, env) == str(path)

    def read():
        while any(w.is_alive() for w in writers):
            if path.exists():
                seen.append(path.read_bytes())

    writers = [threading.Thread(target=write, name=str(n)) for n in range(len(payloads))]
    reader = threading.Thread(target=read)
    for thread in [*writers, reader]:
        thread.start()
    for thread in [*writers, reader]:
        thread.join()
    assert seen and all(p in payloads for p in seen)
    finals, temporaries = _artifact_files(tmp_path / "cache")
    assert finals == [path.name] and temporaries == [] and path.read_bytes() in payloads


def test_concurrent_processes_leave_one_whole_file(tmp_path):
    folder, key = tmp_path / "cache", key_of()
    script = (
        "import sys, torch\n"
        "from runpod_vlm.engine.compile import save_compile_artifacts\n"
        "from runpod_vlm.settings import Settings\n"
        "n = int(sys.argv[1])\n"
        "torch.compiler.save_cache_artifacts = lambda: (bytes([n]) * 300_000, None)\n"
        "settings = Settings.from_env()\n"
        "for _ in range(10):\n"
        "    assert save_compile_artifacts(settings, sys.argv[2])\n"
    )
    env = {**os.environ, "VLM_COMPILE_CACHE_DIR": str(folder), "HF_HOME": str(tmp_path / "hf")}
    writers = [subprocess.Popen([sys.executable, "-c", script, str(n), key], cwd=ROOT, env=env) for n in range(4)]
    assert [w.wait(timeout=120) for w in writers] == [0] * 4
    finals, temporaries = _artifact_files(folder)
    assert finals == [key + COMPILE_ARTIFACTS_SUFFIX] and temporaries == []
    assert (folder / finals[0]).read_bytes() in [bytes([n]) * 300_000 for n in range(4)]


# ---- RunPod's cached models ---------------------------------------------------------------------

REVISION = "317b7eb96312eda0c431d1dab1af958a308cb35e"


def fake_hub_cache(root: Path, repo_id: str, files: dict[str, bytes], ref: bool = True, revision: str = REVISION):
    """A hub cache tree as huggingface_hub (and RunPod) lays it out: blobs, refs/main, and a
    snapshot whose files are relative links to the blobs."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for n, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{n}-{revision[:6]}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snapshot


MODEL_FILES = {"config.json": b"{}", "model.safetensors": b"weights", "tokenizer.json": b"{}"}


def test_a_cached_model_resolves_to_its_snapshot(tmp_path, caplog):
    snapshot = fake_hub_cache(tmp_path, "Qwen/Qwen2-VL-2B-Instruct", MODEL_FILES)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert weights_source("Qwen/Qwen2-VL-2B-Instruct", str(tmp_path)) == str(snapshot)
    assert "RunPod's cached models" in caplog.records[-1].getMessage()


def test_a_model_not_cached_resolves_to_its_id(tmp_path):
    fake_hub_cache(tmp_path, "llava-hf/llava-1.5-7b-hf", MODEL_FILES)
    for hub_cache in (tmp_path, tmp_path / "absent"):
        assert weights_source("Qwen/Qwen2-VL-2B-Instruct", str(hub_cache)) == "Qwen/Qwen2-VL-2B-Instruct"
    assert not (tmp_path / "absent").exists()  # looking never makes /runpod-volume appear


def test_a_local_folder_is_used_as_given(tmp_path):
    assert weights_source(str(tmp_path), str(tmp_path / "absent")) == str(tmp_path)


def test_without_refs_the_only_snapshot_is_used_and_two_are_ambiguous(tmp_path):
    snapshot = fake_hub_cache(tmp_path, "Org/Model", MODEL_FILES, ref=False)
    assert weights_source("Org/Model", str(tmp_path)) == str(snapshot)
    fake_hub_cache(tmp_path, "Org/Model", MODEL_FILES, ref=False, revision="a" * 40)
    assert weights_source("Org/Model", str(tmp_path)) == "Org/Model"


def test_an_incomplete_snapshot_is_not_used(tmp_path, caplog):
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
    files = {
        "config.json": b"{}",
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"half",
    }
    snapshot = fake_hub_cache(tmp_path, "Org/Sharded", files)
    # A link to a blob that never arrived (an interrupted download) counts as missing.
    (snapshot / "model-00002-of-00002.safetensors").symlink_to("../../blobs/never-downloaded")
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert weights_source("Org/Sharded", str(tmp_path)) == "Org/Sharded"
    assert "model-00002-of-00002.safetensors" in caplog.records[-1].getMessage()
    no_weights = fake_hub_cache(tmp_path, "Org/Empty", {"config.json": b"{}"})
    assert missing_model_files(str(no_weights)) == ["weights (*.safetensors)"]


def test_transformers_loads_the_resolved_snapshot(tiny_model, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_model("qwen2-vl")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    fake_hub_cache(tmp_path, "Org/tiny-qwen2-vl", files)
    source = weights_source("Org/tiny-qwen2-vl", str(tmp_path))
    assert source != "Org/tiny-qwen2-vl"
    model = AutoModelForImageTextToText.from_pretrained(source, device_map="cpu")
    AutoProcessor.from_pretrained(source)
    original = AutoModelForImageTextToText.from_pretrained(folder, device_map="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))


def prefill(engine, decoder, parts: list, count: int = 1, first_row: int = 0, new_tokens: int = 8) -> None:
    """`count` greedy chats of one user turn of `parts`, prefilled into the rows from `first_row`."""
    params = GenerationParams(max_new_tokens=new_tokens, temperature=0.0, top_p=1.0, do_sample=False)
    items = [GenerationRequest("chat", [Turn("user", parts)], params)] * count
    inputs, _ = engine.adapter.batch_inputs(engine.processor, items, engine.model.device, engine.dtype)
    decoder.prompts.prefill(inputs, list(range(first_row, first_row + count)), [params] * count)


def step(decoder, steps: int) -> list:
    """`decoder.step(steps)` once every busy row holds the blocks for `steps` more tokens (the engine's part)."""
    for row, length in decoder.lengths.items():
        decoder.grow(row, length + steps)
    return decoder.step(steps)


def compile_in_background(engine, monkeypatch, buckets: list[int], backend) -> None:
    """The engine's background compile of `buckets` with dynamo and `backend`, waited for."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, **options: compile_(fn, dynamic=dynamic, backend=backend))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(background_compile, "COMPILE_AFTER_FIRST_ANSWER_S", 0)
    monkeypatch.setattr(background_compile, "load_compile_artifacts", lambda *args: False)
    monkeypatch.setattr(background_compile, "save_compile_artifacts", lambda *args: None)
    engine.compiler.start(buckets)
    engine.compiler.finish()


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_a_compiled_decode_step_is_traced_once_whatever_the_prefills(tiny_model, serve, family):
    # Qwen's M-RoPE models keep the last prompt's rope deltas, sized by its batch, and return them from every
    # forward: the compiled step was traced anew after each prefill of another size (a 6 s stall on the GPU),
    # and past torch's recompile limit fell back to eager. Compiled whole, as the engine compiles a model without a
    # list of decoder layers, and traced over views of the model, by dynamo with a counting backend.
    from PIL import Image

    engine = serve(tiny_model(family), VLM_COMPILE="false")
    traces = []
    forward = torch.compile(
        model_view(engine.model).__call__,
        dynamic=False,
        backend=lambda graph, example_inputs: traces.append(graph) or graph.forward,
    )
    shadow = PagedDecoder(
        model_view(engine.model), engine.eos_ids, rows=16, blocks=64, block_size=16, use_graph=False, interval=8
    )
    decoder = PagedDecoder(engine.model, engine.eos_ids, rows=16, blocks=64, block_size=16, use_graph=False, interval=8)
    plans = [
        (shadow, ["warm up"], 8, 0),
        (decoder, [Image.new("RGB", (64, 64)), "Hi."], 1, 0),
        (decoder, [Image.new("RGB", (96, 64)), "Say."], 3, 1),
    ]
    with torch.inference_mode():
        for step, (slots, parts, count, first_row) in enumerate(plans):
            prefill(engine, slots, parts, count, first_row)
            slots.use_forward(8, forward)
            slots.advance(8, 256)
            if step == 0:
                traced = len(traces)
    assert traced >= 1 and len(traces) == traced  # the shadow's trace served every later step


@pytest.mark.parametrize("family", ["qwen2-vl", "gemma3", "llama4"])
def test_the_step_compiles_one_decoder_layer_per_shape_and_decodes_as_the_plain_forward(
    tiny_model, serve, monkeypatch, family
):
    # Compiling the whole unrolled model took 35-40 s a shape on the H200; one layer, run for all, is traced and
    # compiled once per shape (a layer's cache index, read by dynamo, would have made every layer a trace of its own).
    # Gemma 3's sliding and full layers traced twice a shape (past dynamo's recompile limit at 256 rows), and Llama 4,
    # whose layers sit inside its causal LM, compiled whole.
    engine = serve(tiny_model(family), VLM_COMPILE="false", VLM_MAX_BATCH_SIZE="16")
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in decoder_layers(engine.model)]
    traces = []
    compile_in_background(
        engine, monkeypatch, [8, 16], backend=lambda graph, example_inputs: traces.append(graph) or graph.forward
    )
    assert engine.view().compiled_row_buckets == (8, 16) and len(windows) == 2
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in decoder_layers(engine.model)] == windows
    # Four graphs a shape around the paged attention, which runs eagerly: the layer and its attention, before and after;
    # Llama 4's attention once more for its full layers, which skip RoPE.
    graphs = 5 if family == "llama4" else 4
    assert len(traces) == 2 * graphs and not any("embed_tokens" in graph.code for graph in traces)
    tokens = []
    for forward in (engine.model, engine.compiler.forward):
        decoder = PagedDecoder(
            engine.model, engine.eos_ids, rows=16, blocks=64, block_size=16, use_graph=False, interval=4
        )
        for bucket in decoder.buckets:
            decoder.use_forward(bucket, forward)
        with torch.inference_mode():
            prefill(engine, decoder, ["Say hi. " * 6], new_tokens=16)  # row 0: 8-row steps
            assert family != "gemma3" or decoder.lengths[0] < windows[0] < decoder.lengths[0] + 12  # decodes past it
            tokens.append(step(decoder, 4))
            prefill(engine, decoder, ["Count."], count=2, first_row=8, new_tokens=8)  # rows 8-9: 16-row steps
            tokens.append(step(decoder, 4) + step(decoder, 4))
    assert tokens[:2] == tokens[2:] and len(traces) == 2 * graphs


def test_every_bucket_of_256_rows_compiles_where_a_layer_class_traces_twice_a_shape(tiny_model, serve, monkeypatch):
    # Six buckets of two traces each passed dynamo's default limit of 8 traces a function: the largest buckets decoded
    # with their attention eager.
    engine = serve(tiny_model("llama4"), VLM_COMPILE="false", VLM_MAX_BATCH_SIZE="256")
    traces = []
    buckets = row_buckets(256)
    compile_in_background(
        engine, monkeypatch, buckets, backend=lambda graph, example: traces.append(graph) or graph.forward
    )
    assert len(buckets) == 6 and len(traces) == 6 * 5


def test_a_failed_cuda_graph_capture_is_tried_again_at_a_later_step(tiny_model, serve, monkeypatch):
    # On the H200 a capture that overlapped the background compile failed, and the worker then decoded
    # without graphs for good. A failed capture is now tried again, up to 3 times in all.
    engine = serve(tiny_model("qwen2-vl"), VLM_COMPILE="false")
    decoder = PagedDecoder(engine.model, engine.eos_ids, rows=8, blocks=64, block_size=16, use_graph=True, interval=2)
    tries = []

    def capture(bucket, span):
        tries.append(bucket)
        if len(tries) in (1, 3, 4):
            raise RuntimeError("operation not permitted when stream is capturing")
        decoder.step_graphs.graphs.clear()  # recorded, then dropped (as a switch of forward does): the next try seen

    monkeypatch.setattr(decoder.step_graphs, "_capture", capture)
    with torch.inference_mode():
        prefill(engine, decoder, ["hi"], new_tokens=40)
        step(decoder, 2)
        assert tries == [8] and decoder.step_graphs.enabled  # failed once: tried again at the next step
        step(decoder, 2)
        assert tries == [8, 8] and decoder.step_graphs.enabled
        for _ in range(4):
            step(decoder, 2)
    assert tries == [8] * 4 and not decoder.step_graphs.enabled  # a third failure: no more tries


def test_a_prefill_on_the_engine_thread_during_the_compile_does_not_fail_it(tiny_model, serve, monkeypatch):
    # On the H200 the 8-row compile failed twice while the worker served: dynamo traced Qwen's rope_deltas as
    # None and, when it built its guards, the engine thread's prefill had just set them. The backend below
    # runs between the two, as that prefill did. The compile thread now traces a view of the model.
    engine = serve(tiny_model("qwen2-vl"), VLM_COMPILE="false")

    def prefill_meanwhile(graph, example_inputs):
        engine.model.base_model.rope_deltas = torch.zeros(3, 1, dtype=torch.long)  # 3 rows, midway
        return graph.forward

    compile_in_background(engine, monkeypatch, [8], prefill_meanwhile)
    assert engine.view().compiled_row_buckets == (8,)
    tokens = []
    for forward in (engine.model, engine.compiler.forward):  # the view's compiled step decodes as the model
        decoder = PagedDecoder(
            engine.model, engine.eos_ids, rows=8, blocks=64, block_size=16, use_graph=False, interval=4
        )
        decoder.use_forward(8, forward)
        with torch.inference_mode():
            prefill(engine, decoder, ["Say hi."], new_tokens=8)
            tokens.append(step(decoder, 4) + step(decoder, 4))
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("shared", [False, True], ids=["projections-apart", "one-product-a-group"])
def test_jobs_answered_while_the_step_compiles_and_after_get_their_eager_tokens(
    tiny_model, serve, tmp_path, monkeypatch, shared
):
    # The whole background compile for real, on CPU (inductor's C++ backend; no CUDA graphs): jobs of several
    # lengths and images, sent together again and again while the step compiles and once it is switched to,
    # get exactly the tokens of the plain forward; also with the projections that share an input computed as one
    # product (engine/projections.py, as a worker that compiles loads them).
    from tools.sample_images import data_uri, striped

    engine = serve(
        tiny_model("qwen2-vl"),
        VLM_COMPILE="false",
        VLM_MAX_BATCH_SIZE="4",
        VLM_SYNC_INTERVAL="2",
        VLM_COMPILE_CACHE_DIR=str(tmp_path),
    )
    jobs = [
        {
            "task": "vqa",
            "image_url": data_uri(striped((40 + 8 * n, 40))),
            "question": f"What is {n}?",
            "max_new_tokens": 6 + 4 * n,
            "min_new_tokens": 6 + 4 * n,
        }
        for n in range(3)
    ]
    jobs.append({"messages": [{"role": "user", "content": "No image."}], "max_new_tokens": 12})
    eager = [asyncio.run(handler.local_test_answer({"id": "eager", "input": job})) for job in jobs]
    if shared:
        assert share_weights(engine.model) > 0

    async def together():
        return await asyncio.gather(
            *(handler.local_test_answer({"id": str(n), "input": job}) for n, job in enumerate(jobs))
        )

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(background_compile, "COMPILE_AFTER_FIRST_ANSWER_S", 0)
    engine.compile, engine.decoder = True, None  # the next decoder compiles its step in the background
    rounds = []
    while not engine.wait_until_compiled(0) and len(rounds) < 200:
        rounds.append(asyncio.run(together()))
    assert engine.wait_until_compiled(120)
    rounds.append(asyncio.run(together()))
    assert len(rounds) > 1 and all(answers == eager for answers in rounds)
