"""Fuzzing settings.json (hypothesis, derandomized for CI; `slow` runs ten times more with fresh randomness).

Properties, for any bytes in the file: read_settings never raises; what it returns passes its own checks (so the
settings dialog and the engine take it); a value that was dropped is named in a message; the file's bytes are
never lost (they stay in place or in a settings.json.bad-* copy).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.session import ChatSettings
from engine.settings import FIELD_RULES, SAMPLING_RULES, check_settings, read_settings, settings_to_dict

QUICK = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LONG = settings(max_examples=3000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=40)
           | st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 32768, 1e308, "refuse", "drop_oldest", "", "NaN"]))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                       max_size=3), max_leaves=12)
sampling_dicts = st.dictionaries(st.sampled_from(sorted(SAMPLING_RULES) + ["bogus"]), json_values, max_size=8)
settings_dicts = st.dictionaries(
    st.sampled_from(sorted(FIELD_RULES) + ["sampling", "unknown"]),
    json_values | sampling_dicts, max_size=9)


def dump(value) -> bytes:
    try:
        return json.dumps(value, allow_nan=True).encode()
    except (ValueError, RecursionError):
        return b"{}"


file_bytes = st.one_of(
    settings_dicts.map(dump),
    st.binary(max_size=200),
    settings_dicts.map(dump).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),  # torn writes
    st.integers(1, 50_000).map(lambda n: b"[" * n + b"]" * n),
)


def check_file(folder, content: bytes) -> None:
    path = folder / "settings.json"
    for old in folder.glob("settings.json*"):
        old.unlink()
    path.write_bytes(content)
    loaded, problems = read_settings(path)
    assert isinstance(loaded, ChatSettings)
    again, more = check_settings(settings_to_dict(loaded))
    assert more == [] and again == loaded  # what was kept is valid by the same rules
    kept = [p.read_bytes() for p in folder.glob("settings.json*")]
    assert content in kept  # in place, or in a .bad-* copy: never lost
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        _, expected = check_settings(data, where=str(path))
        assert problems[:len(expected)] == expected
    elif content:
        assert len(problems) == 1 and "could not be read" in problems[0]


@QUICK
@given(content=file_bytes)
def test_any_settings_file_loads_valid_settings_and_loses_nothing(tmp_path, content):
    check_file(tmp_path, content)


@pytest.mark.slow
@LONG
@given(content=file_bytes)
def test_any_settings_file_long(tmp_path, content):
    check_file(tmp_path, content)


@QUICK
@given(data=settings_dicts)
def test_each_bad_field_is_named_and_each_good_one_kept(data):
    loaded, problems = check_settings(data)
    for name, (ok, _) in FIELD_RULES.items():
        if name in data and ok(data[name]):
            assert getattr(loaded, name) == data[name]
        elif name in data:
            assert any(p.startswith(f"settings: {name} must be ") for p in problems)
        else:
            assert getattr(loaded, name) == getattr(ChatSettings(), name)
