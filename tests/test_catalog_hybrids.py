"""The catalog's Qwen3.5-4B and both Qwen3.6-35B-A3B entries, as listed (repo id, pinned revision, file patterns,
format, architecture), driven through the app: Download from a local hub that serves a tiny stand-in of the same
architecture and format under that repo id, the finished download loads by itself, and the model answers.
Only the sizes are the stand-in's: the real ones would not fit a CI machine's disk."""

import json

import pytest

from engine import catalog
from engine.cli import main as cli_main
from tests.helpers import cached_mlx, cached_tiny_hf, open_window, send, wait_idle, wait_loaded

pytestmark = [pytest.mark.model, pytest.mark.gpu]

SIZE_FIELDS = ("total_bytes", "weights_bytes", "largest_tensor_bytes")


def stand_in_files(key: str, tmp_path) -> dict[str, bytes]:
    """A tiny checkpoint in the entry's format: an MLC q4f16_1 build of a tiny Qwen3.5 (our converter, as MLC's
    own builds are laid out), or an MLX Qwen3.5-MoE made by mlx-lm (4-bit, or with 3-bit routed experts)."""
    if key == "qwen3.5-4b-q4f16_1":
        build = tmp_path / "build"
        assert cli_main(["convert", str(cached_tiny_hf("qwen3_5")), str(build), "--format", "q4f16_1"]) == 0
        (build / "ndarray-cache.json").rename(build / "tensor-cache.json")  # the manifest's name in MLC's Qwen3.5 repo
        folder = build
    else:
        folder = cached_mlx("q3exp" if key.endswith("q3") else "q4")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != "generation_config.json"}


@pytest.fixture(params=["qwen3.5-4b-q4f16_1", "qwen3.6-35b-a3b-mlx-4bit", "qwen3.6-35b-a3b-mlx-q3"])
def listed(request, hub, tmp_path, monkeypatch):
    key = request.param
    raw = json.loads(catalog.catalog_path().read_text())
    entry = next(m for m in raw["models"] if m["key"] == key)
    files = stand_in_files(key, tmp_path)
    repo = hub.add_repo(entry["repo"], files)
    if entry["revision"]:  # the stand-in is the pinned commit
        repo.commit = entry["revision"]
        repo.revisions = {"main": repo.commit, repo.commit: repo.commit}
    size = sum(len(b) for name, b in files.items() if catalog_matches(entry["files"], name))
    entry.update({f: size for f in SIZE_FIELDS}, ram_warning_bytes=size if entry.get("ram_warning_bytes") else None)
    path = tmp_path / "models.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(catalog, "catalog_path", lambda: path)
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ZEROTVM_MODELS", str(tmp_path / "models"))
    return entry, tmp_path / "home"


def catalog_matches(patterns: list[str], name: str) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in patterns)


@pytest.mark.slow
def test_listed_hybrid_downloads_loads_and_answers_in_the_app(qtbot, listed, hub):
    entry, home = listed
    w = open_window(qtbot, home, auto_setup=False)
    try:
        w.picker.setCurrentIndex(w.picker.findData(entry["key"]))
        assert w.action.text() == "Download"
        w.action.click()
        qtbot.waitUntil(lambda: w.downloading_key is None, timeout=60_000)
        assert w.row(entry["key"]).installed, w.status.text()
        # The catalog's patterns fetched what the model needs, and nothing of the repo they do not name.
        got = {p.name for p in (home.parent / "models" / entry["key"]).iterdir() if not p.name.startswith(".")}
        assert any(n.endswith((".safetensors", ".bin")) for n in got) and "tokenizer.json" in got
        assert all(catalog_matches(entry["files"], n) or n == "generation_config.json" for n in got)
        if entry["revision"]:
            fetched = [r.path for r in hub.requests if r.server == "hub" and "/resolve/" in r.path]
            assert fetched and all(f"/resolve/{entry['revision']}/" in p for p in fetched)
        wait_loaded(qtbot, w)  # a finished download loads by itself
        assert w.facts["model_type"].startswith(entry["architecture"])
        send(qtbot, w, "Hello")
        wait_idle(qtbot, w)
        assert [m["role"] for m in w.store.messages(w.conv_id)] == ["user", "assistant"]
    finally:
        w.close()
