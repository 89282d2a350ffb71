"""Cold start: the compile-artifact cache (key, folders, file format, concurrent writers, read-only
volumes, one real round trip through torch's mega-cache) and RunPod's cached-model resolution.

Real torch on CPU throughout. `torch.compiler.load_cache_artifacts` / `save_cache_artifacts` are
replaced by recorders only where a test is about what reaches torch (a file that must never reach
it, or a payload the test chose); the round trip at the end runs the real ones in fresh processes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

import handler

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
    return handler.compile_cache_key(model_id, **{**KEY_INPUTS, **changes})


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
    monkeypatch.setattr(handler, "RUNPOD_VOLUME", str(volume))
    monkeypatch.setattr(handler, "_reported_unwritable", set())
    env = {"HF_HOME": str(tmp_path / "hf")}
    return {
        "env": env,
        "settings": handler.Settings.from_env(env),
        "volume": volume / "vlm-compile-cache",
        "container": tmp_path / "hf" / "compile-cache",
    }


@pytest.fixture
def torch_loads(monkeypatch):
    """Records every payload handed to torch.compiler.load_cache_artifacts."""
    payloads = []

    class Info:
        artifacts = {"inductor": ["a", "b"], "triton": ["c"]}

    def load(payload):
        payloads.append(payload)
        return Info()

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return payloads


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
        "config": key_of(config={"model_type": "qwen2_vl", "text_config": {"hidden_size": 1536, "num_hidden_layers": 27}}),
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
    assert handler.compile_cache_key("m", config=small) == handler.compile_cache_key("m", config=Qwen2VLConfig())
    assert handler.compile_cache_key("m", config=small) != handler.compile_cache_key("m", config=large)
    runtime = handler.runtime_fingerprint()
    assert runtime["torch"] == torch.__version__ and runtime["gpu"] == "cpu"
    assert handler.compile_cache_key("m") == handler.compile_cache_key("m", runtime=runtime)


# ---- folders ------------------------------------------------------------------------------------


def test_folders_prefer_the_network_volume_then_the_container(folders, tmp_path, monkeypatch):
    env, settings = folders["env"], folders["settings"]
    assert handler.compile_artifact_dirs(settings, env) == [str(folders["volume"]), str(folders["container"])]

    explicit = {**env, "VLM_COMPILE_CACHE_DIR": str(tmp_path / "mine")}
    assert handler.compile_artifact_dirs(handler.Settings.from_env(explicit), explicit) == [
        str(tmp_path / "mine"), str(folders["container"])
    ]

    monkeypatch.setattr(handler, "RUNPOD_VOLUME", str(tmp_path / "no-volume-here"))
    assert handler.compile_artifact_dirs(settings, env) == [str(folders["container"])]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert handler.compile_artifact_dirs(handler.Settings.from_env({}), {}) == [
        str(tmp_path / "home" / ".cache" / "runpod-vlm" / "compile-cache")
    ]


def test_torch_caches_follow_the_setting_and_leave_an_unwritable_one(folders, tmp_path, monkeypatch, caplog):
    handler.set_torch_cache_dirs(folders["settings"], folders["env"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folders["container"] / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folders["container"] / "triton")

    # Tests run as root, which chmod cannot stop: a file stands where the folder should be.
    (tmp_path / "a-file").write_text("")
    env = {**folders["env"], "VLM_COMPILE_CACHE_DIR": str(tmp_path / "a-file" / "cache")}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        handler.set_torch_cache_dirs(handler.Settings.from_env(env), env)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folders["container"] / "inductor")
    assert [r.levelno for r in compile_cache_records(caplog)] == [logging.WARNING]

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/chosen")  # an operator's own choice stays
    handler.set_torch_cache_dirs(folders["settings"], folders["env"])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/chosen"


# ---- loading: what reaches torch --------------------------------------------------------------


def test_a_saved_file_loads_and_reaches_torch_whole(folders, torch_loads, caplog):
    key, payload = key_of(), os.urandom(100_000)
    handler.write_compile_artifacts(str(folders["volume"]), key, payload, RUNTIME)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == [payload]
    [record] = compile_cache_records(caplog)
    assert record.levelno == logging.INFO and "loaded" in record.getMessage()


def test_no_file_is_one_line_and_no_torch_call(folders, torch_loads, caplog):
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key_of(), folders["env"]) is False
    assert torch_loads == []
    [record] = compile_cache_records(caplog)
    assert "no artifacts" in record.getMessage()


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    header_end = data.index(b"\n", len(handler._ARTIFACTS_MAGIC)) + 1
    if how == "truncated payload":
        path.write_bytes(data[:-10])
    elif how == "truncated header":
        path.write_bytes(data[: header_end - 20])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "payload byte flipped":
        flipped = bytearray(data)
        flipped[header_end + 1000] ^= 0xFF
        path.write_bytes(bytes(flipped))
    elif how == "wrong checksum":
        header = json.loads(data[len(handler._ARTIFACTS_MAGIC) : header_end])
        header["sha256"] = "0" * 64
        path.write_bytes(handler._ARTIFACTS_MAGIC + json.dumps(header).encode() + b"\n" + data[header_end:])
    elif how == "appended to":
        path.write_bytes(data + b"more")
    elif how == "header not json":
        path.write_bytes(handler._ARTIFACTS_MAGIC + b"{not json\n" + data[header_end:])


@pytest.mark.parametrize(
    "how",
    ["truncated payload", "truncated header", "empty", "garbage", "payload byte flipped", "wrong checksum",
     "appended to", "header not json"],
)
def test_a_corrupt_file_never_reaches_torch(folders, torch_loads, caplog, how):
    key = key_of()
    path = Path(handler.write_compile_artifacts(str(folders["volume"]), key, os.urandom(50_000), RUNTIME))
    _corrupt(path, how)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    assert torch_loads == []
    [record] = compile_cache_records(caplog)
    assert record.levelno == logging.WARNING and str(path) in record.getMessage()


def test_a_mismatched_file_never_reaches_torch(folders, torch_loads, caplog):
    key, folder = key_of(), str(folders["volume"])
    # Another key's file under this key's name (copied or renamed by hand).
    other = handler.write_compile_artifacts(folder, key_of(dtype="torch.float16"), b"x" * 1000, RUNTIME)
    os.replace(other, handler.compile_artifacts_path(folder, key))
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    assert "another key" in compile_cache_records(caplog)[-1].getMessage()

    # A file written by another torch, even under the same key.
    handler.write_compile_artifacts(folder, key, b"y" * 1000, {**RUNTIME, "torch": "2.8.0+cu128"})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    [record] = compile_cache_records(caplog)
    assert "torch 2.8.0+cu128" in record.getMessage()
    assert torch_loads == []


def test_torch_refusing_a_valid_file_is_one_line_not_a_crash(folders, monkeypatch, caplog):
    def refuse(payload):
        raise RuntimeError("unpickling failed")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuse)
    key = key_of()
    handler.write_compile_artifacts(str(folders["volume"]), key, b"z" * 1000, RUNTIME)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is False
    [record] = compile_cache_records(caplog)
    assert "unpickling failed" in record.getMessage()


def test_a_bad_volume_file_falls_back_to_the_container_copy(folders, torch_loads, caplog):
    key, good = key_of(), b"g" * 2000
    bad = Path(handler.write_compile_artifacts(str(folders["volume"]), key, b"b" * 2000, RUNTIME))
    _corrupt(bad, "truncated payload")
    handler.write_compile_artifacts(str(folders["container"]), key, good, RUNTIME)
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == [good]
    assert [r.levelno for r in compile_cache_records(caplog)] == [logging.WARNING, logging.INFO]


# ---- saving -------------------------------------------------------------------------------------


@pytest.fixture
def torch_saves(monkeypatch):
    """torch.compiler.save_cache_artifacts returning the payload a test puts in the list."""
    payload = [os.urandom(30_000)]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload[0], None))
    return payload


def test_save_writes_the_volume_and_skips_an_identical_rewrite(folders, torch_saves, torch_loads):
    key = key_of()
    path = handler.save_compile_artifacts(folders["settings"], key, folders["env"])
    assert path == handler.compile_artifacts_path(str(folders["volume"]), key)
    written = os.stat(path)
    assert handler.save_compile_artifacts(folders["settings"], key, folders["env"]) == path
    assert os.stat(path).st_ino == written.st_ino  # the same artifacts are not written again
    assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == torch_saves


def test_a_damaged_copy_of_the_same_artifacts_is_written_again(folders, torch_saves):
    key = key_of()
    path = Path(handler.save_compile_artifacts(folders["settings"], key, folders["env"]))
    _corrupt(path, "truncated payload")  # header intact, payload short
    assert handler.save_compile_artifacts(folders["settings"], key, folders["env"]) == str(path)
    assert handler.read_compile_artifacts(str(path), key, torch.__version__) == torch_saves[0]


def test_save_with_nothing_compiled_writes_nothing(folders, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert handler.save_compile_artifacts(folders["settings"], key_of(), folders["env"]) is None
    assert not folders["volume"].exists() and not folders["container"].exists()


def test_an_unwritable_volume_falls_back_to_the_container_with_one_line(folders, torch_saves, caplog, monkeypatch):
    # A read-only file system refuses to create files (root included): mkstemp in the volume
    # raises EROFS, as it would there. The volume's folder exists and is readable.
    folders["volume"].mkdir()
    real_mkstemp = tempfile.mkstemp

    def read_only_volume(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == folders["volume"]:
            raise OSError(errno.EROFS, "Read-only file system", dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only_volume)
    key = key_of()
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        first = handler.save_compile_artifacts(folders["settings"], key, folders["env"])
        torch_saves[0] = os.urandom(30_000)
        second = handler.save_compile_artifacts(folders["settings"], key, folders["env"])
    assert first == second == handler.compile_artifacts_path(str(folders["container"]), key)
    assert handler.read_compile_artifacts(second, key, torch.__version__) == torch_saves[0]
    warnings = [r for r in compile_cache_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(folders["volume"]) in warnings[0].getMessage()
    assert os.listdir(folders["volume"]) == []


def test_a_file_where_the_folder_should_be_falls_back_too(folders, torch_saves, tmp_path):
    (tmp_path / "a-file").write_text("")
    env = {**folders["env"], "VLM_COMPILE_CACHE_DIR": str(tmp_path / "a-file" / "cache")}
    path = handler.save_compile_artifacts(handler.Settings.from_env(env), key_of(), env)
    assert path == handler.compile_artifacts_path(str(folders["container"]), key_of())


def test_nowhere_writable_saves_nothing_and_does_not_raise(folders, torch_saves, tmp_path):
    folders["volume"].write_text("")  # files where both folders should be
    (tmp_path / "hf").write_text("")
    assert handler.save_compile_artifacts(folders["settings"], key_of(), folders["env"]) is None


def test_a_read_only_volume_still_serves_its_artifacts(folders, torch_loads, monkeypatch):
    key, payload = key_of(), b"r" * 5000
    handler.write_compile_artifacts(str(folders["volume"]), key, payload, RUNTIME)
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
    assert handler.load_compile_artifacts(folders["settings"], key, folders["env"]) is True
    assert torch_loads == [payload]


# ---- concurrent writers -------------------------------------------------------------------------


def _artifact_files(folder: Path) -> tuple[list[str], list[str]]:
    names = os.listdir(folder)
    return [n for n in names if n.endswith(handler.COMPILE_ARTIFACTS_SUFFIX)], [n for n in names if n.endswith(".tmp")]


def test_concurrent_writers_leave_one_whole_file_and_readers_never_see_a_part(tmp_path):
    folder, key = str(tmp_path / "cache"), key_of()
    payloads = [bytes([n]) * 400_000 for n in range(8)]
    writing = threading.Event()
    seen, errors = [], []

    def write(payload):
        for _ in range(5):
            handler.write_compile_artifacts(folder, key, payload, RUNTIME)
            writing.set()

    def read():
        writing.wait()
        path = handler.compile_artifacts_path(folder, key)
        while any(w.is_alive() for w in writers):
            try:
                seen.append(handler.read_compile_artifacts(path, key, torch.__version__))
            except Exception as error:  # any failure here is a reader seeing a partial file
                errors.append(error)

    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    reader = threading.Thread(target=read)
    for thread in [*writers, reader]:
        thread.start()
    for thread in [*writers, reader]:
        thread.join()
    assert errors == [] and seen and all(p in payloads for p in seen)
    finals, temporaries = _artifact_files(Path(folder))
    assert finals == [key + handler.COMPILE_ARTIFACTS_SUFFIX] and temporaries == []
    assert handler.read_compile_artifacts(os.path.join(folder, finals[0]), key, torch.__version__) in payloads


def test_concurrent_processes_leave_one_whole_file(tmp_path):
    folder, key = tmp_path / "cache", key_of()
    script = (
        "import sys, handler\n"
        "n = int(sys.argv[1])\n"
        "for _ in range(10):\n"
        "    handler.write_compile_artifacts(sys.argv[2], sys.argv[3], bytes([n]) * 300_000, {'torch': sys.argv[4]})\n"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(n), str(folder), key, torch.__version__], cwd=ROOT)
        for n in range(4)
    ]
    assert [w.wait(timeout=120) for w in writers] == [0] * 4
    finals, temporaries = _artifact_files(folder)
    assert finals == [key + handler.COMPILE_ARTIFACTS_SUFFIX] and temporaries == []
    payload = handler.read_compile_artifacts(str(folder / finals[0]), key, torch.__version__)
    assert payload in [bytes([n]) * 300_000 for n in range(4)]


def test_a_dead_writers_old_temporary_is_removed_and_a_fresh_one_kept(tmp_path):
    folder, key = tmp_path / "cache", key_of()
    folder.mkdir()
    old = folder / f".{key}{handler.COMPILE_ARTIFACTS_SUFFIX}.abc123.tmp"
    fresh = folder / f".{key}{handler.COMPILE_ARTIFACTS_SUFFIX}.def456.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    os.utime(old, (0, 0))
    handler.write_compile_artifacts(str(folder), key, b"done", RUNTIME)
    assert not old.exists() and fresh.exists()


# ---- the real thing: torch's mega-cache across two fresh processes ------------------------------

ROUND_TRIP = """
import json, sys
import torch
from torch._dynamo.utils import counters
import handler

settings = handler.Settings.from_env()
key = handler.compile_cache_key("tiny/matmul", dtype=torch.float32, shapes=[[8, 8]])
loaded = handler.load_compile_artifacts(settings, key)
square = torch.compile(lambda a: a @ a.T)  # an extern matmul: no C++ kernel to build, so quick
square(torch.ones(8, 8))
saved = handler.save_compile_artifacts(settings, key) if sys.argv[1] == "save" else None
print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def test_a_fresh_process_compiles_from_the_artifacts_another_saved(tmp_path):
    """Process 1 compiles (inductor cache miss) and saves; process 2, with empty inductor and
    Triton caches of its own, loads the file and finds the compiled graph in them (a hit, no miss)."""

    def run(step: str) -> dict:
        env = {
            **os.environ,
            "VLM_COMPILE_CACHE_DIR": str(tmp_path / "artifacts"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / step / "inductor"),
            "TRITON_CACHE_DIR": str(tmp_path / step / "triton"),
            "HF_HOME": str(tmp_path / step / "hf"),
        }
        done = subprocess.run([sys.executable, "-c", ROUND_TRIP, step], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = run("save")
    assert first["loaded"] is False and first["misses"] >= 1 and first["hits"] == 0
    assert first["saved"] and Path(first["saved"]).parent == tmp_path / "artifacts"
    second = run("load")
    assert second["loaded"] is True and second["hits"] >= 1 and second["misses"] == 0


# ---- RunPod's cached models ---------------------------------------------------------------------

REVISION = "317b7eb96312eda0c431d1dab1af958a308cb35e"


def fake_hub_cache(root: Path, repo_id: str, files: dict[str, bytes], ref: bool = True, revision: str = REVISION) -> Path:
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
        assert handler.resolve_model_source("Qwen/Qwen2-VL-2B-Instruct", str(tmp_path)) == str(snapshot)
    assert "RunPod's cached models" in caplog.records[-1].getMessage()


def test_a_model_not_cached_resolves_to_its_id(tmp_path):
    fake_hub_cache(tmp_path, "llava-hf/llava-1.5-7b-hf", MODEL_FILES)
    assert handler.resolve_model_source("Qwen/Qwen2-VL-2B-Instruct", str(tmp_path)) == "Qwen/Qwen2-VL-2B-Instruct"
    assert handler.resolve_model_source("Qwen/Qwen2-VL-2B-Instruct", str(tmp_path / "absent")) == "Qwen/Qwen2-VL-2B-Instruct"


def test_a_local_folder_is_used_as_given(tmp_path):
    assert handler.resolve_model_source(str(tmp_path), str(tmp_path / "absent")) == str(tmp_path)


def test_without_refs_the_only_snapshot_is_used_and_two_are_ambiguous(tmp_path):
    snapshot = fake_hub_cache(tmp_path, "Org/Model", MODEL_FILES, ref=False)
    assert handler.resolve_model_source("Org/Model", str(tmp_path)) == str(snapshot)
    fake_hub_cache(tmp_path, "Org/Model", MODEL_FILES, ref=False, revision="a" * 40)
    assert handler.resolve_model_source("Org/Model", str(tmp_path)) == "Org/Model"


def test_an_incomplete_snapshot_is_not_used(tmp_path, caplog):
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
             "model-00001-of-00002.safetensors": b"half"}
    snapshot = fake_hub_cache(tmp_path, "Org/Sharded", files)
    # A link to a blob that never arrived (an interrupted download) counts as missing.
    (snapshot / "model-00002-of-00002.safetensors").symlink_to("../../blobs/never-downloaded")
    with caplog.at_level(logging.INFO, logger="runpod-vlm"):
        assert handler.resolve_model_source("Org/Sharded", str(tmp_path)) == "Org/Sharded"
    assert "model-00002-of-00002.safetensors" in caplog.records[-1].getMessage()
    no_weights = fake_hub_cache(tmp_path, "Org/Empty", {"config.json": b"{}"})
    assert handler._missing_model_files(str(no_weights)) == ["weights (*.safetensors)"]


def test_transformers_loads_the_resolved_snapshot(tiny_model, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = tiny_model("qwen2-vl")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    fake_hub_cache(tmp_path, "Org/tiny-qwen2-vl", files)
    source = handler.resolve_model_source("Org/tiny-qwen2-vl", str(tmp_path))
    assert source != "Org/tiny-qwen2-vl"
    model = AutoModelForImageTextToText.from_pretrained(source, device_map="cpu")
    AutoProcessor.from_pretrained(source)
    original = AutoModelForImageTextToText.from_pretrained(folder, device_map="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), original.state_dict().values()))
