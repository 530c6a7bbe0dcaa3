"""app/prefs.py (app.json): hostile or damaged preference files give the defaults and keep the original aside."""

from __future__ import annotations

import json

import pytest

from app.prefs import MAX_PREFS_BYTES, AppPrefs, load_prefs, save_prefs


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,  # deeper than Python's recursion limit
    b"{not json",
    b"[1, 2, 3]",  # valid JSON, not an object
    b'{"theme": "dark"' + b" " * (MAX_PREFS_BYTES + 1) + b"}",  # past the size bound
    b'{"theme": "\xff"}',  # not UTF-8
], ids=["deep", "broken", "array", "huge", "not-utf8"])
def test_unreadable_prefs_give_defaults_and_keep_a_backup(tmp_path, raw):
    path = tmp_path / "app.json"
    path.write_bytes(raw)
    assert load_prefs(path) == AppPrefs()
    assert not path.exists()
    assert (tmp_path / "app.json.bad").read_bytes() == raw  # the user's file is kept byte for byte


def test_bad_values_fall_back_one_by_one(tmp_path):
    path = tmp_path / "app.json"
    path.write_text(json.dumps({"theme": "neon", "context": -4, "offline": "yes", "adapter": "1",
                                "exact_decode": True, "last_model": 7}))
    prefs = load_prefs(path)
    assert prefs == AppPrefs(adapter="1", exact_decode=True)
    assert path.exists()  # readable JSON is not moved; only its bad values are ignored


def test_a_folder_in_place_of_the_file_gives_defaults(tmp_path):
    (tmp_path / "app.json").mkdir()
    assert load_prefs(tmp_path / "app.json") == AppPrefs()


def test_round_trip(tmp_path):
    prefs = AppPrefs(theme="dark", context=4096, offline=True)
    save_prefs(prefs, tmp_path / "sub" / "app.json")
    assert load_prefs(tmp_path / "sub" / "app.json") == prefs


def test_software_notice_adapters_round_trip_and_bad_lists_fall_back(tmp_path):
    path = tmp_path / "app.json"
    save_prefs(AppPrefs(software_notice_shown=["Vulkan|llvmpipe|Mesa"]), path)
    assert load_prefs(path).software_notice_shown == ["Vulkan|llvmpipe|Mesa"]
    for bad in ("Vulkan|llvmpipe|Mesa", [1, 2], [["x"]], None):
        path.write_text(json.dumps({"software_notice_shown": bad, "theme": "dark"}))
        assert load_prefs(path) == AppPrefs(theme="dark")  # the notice shows again; nothing else is lost
