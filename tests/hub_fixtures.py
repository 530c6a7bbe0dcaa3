"""Fixtures shared by the download tests: a local Hub stand-in (tests/hub_server.py) with the environment
pointed at it and every non-loopback connection refused, and an in-memory keyring."""

from __future__ import annotations

import json
import random

import keyring
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import close_session
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

from engine.hub import download
from tests.hub_server import HubServer
from tests.net_guard import no_connections

TOKEN = "hf_test_0123456789abcdef"
REPO = "acme/tiny-model"
BIG = random.Random(0).randbytes(2_500_000)  # served as an LFS file, through the "CDN"
FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
    "tokenizer.json": json.dumps({"vocab": {f"t{i}": i for i in range(3000)}}).encode(),  # ~50 KB, not LFS
    "model.safetensors": BIG,
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    ".github/workflows/ci.yml": b"on: push\n",
}



class MemoryKeyring(KeyringBackend):
    """A keyring backend that keeps passwords in a dict, installed with keyring.set_keyring."""
    priority = 1

    def __init__(self):
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.passwords.get((service, username))

    def set_password(self, service, username, password):
        self.passwords[(service, username)] = password

    def delete_password(self, service, username):
        if self.passwords.pop((service, username), None) is None:
            raise PasswordDeleteError("not set")


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture
def hub(monkeypatch, tmp_path, memory_keyring):
    server = HubServer(token=TOKEN).start()
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
    server.add_repo(REPO, FILES)
    with no_connections(allow_loopback=True) as attempts:
        yield server
    server.stop()
    assert attempts == [], f"a test tried to reach the network: {attempts}"
