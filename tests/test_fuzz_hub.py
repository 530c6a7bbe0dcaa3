"""Fuzzing the download protocol: seeded random schedules of server faults (tests/hub_server.py on 127.0.0.1:
drops, corruption, statuses, ignored or wrong Ranges, answers cut short, endless bodies, redirect loops, hostile
listings) against download_model, and hypothesis over the names a server can send.

Properties of every schedule: download_model ends within a time bound, either with every file byte-identical to
the server's and the model installed, or with one DownloadError sentence; no file's bytes take more requests than
its budget; nothing is written outside the destination folder; and a later download from a sound server
installs the model from whatever the failed one left behind.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.hub import download, names, state
from engine.hub.download import DownloadError, download_model, is_installed, verify_installed
from tests.helpers import HUB_FILES as FILES
from tests.helpers import HUB_REPO as REPO

WANTED = ["config.json", "model.safetensors", "tokenizer.json"]
STATUSES = [500, 502, 503, 504, 429, 408, 404, 403, 401, 416, 410]
HOSTILE_LISTINGS = [
    lambda info: {**info, "sha": "../../../x"},
    lambda info: {**info, "siblings": info["siblings"] + [{"rfilename": "../../escape.json", "size": 3}]},
    lambda info: {**info, "siblings": info["siblings"] + [{"rfilename": "/abs/path.json", "size": 3}]},
    lambda info: {**info, "siblings": [{**s, "lfs": {**s["lfs"], "sha256": "../" * 20 + "a" * 4}} if "lfs" in s
                                       else s for s in info["siblings"]]},
    lambda info: {**info, "siblings": [{**s, "blobId": "../../zz"} if "lfs" not in s else s
                                       for s in info["siblings"]]},
    lambda info: {**info, "siblings": [{**s, "size": -5} for s in info["siblings"]]},
    lambda info: {**info, "siblings": [{**s, "size": s.get("size", 0) + 7} for s in info["siblings"]]},  # lies
    lambda info: {**info, "siblings": "not a list"},
    lambda info: [info],
]


def tree(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def random_schedule(server, rng: random.Random) -> list[str]:
    """Switch on a random mix of faults; returns their names (for the failure message)."""
    f, on = server.faults, []
    for path in WANTED:
        size = len(FILES[path])
        roll = rng.random()
        if roll < 0.15:
            f.drop_after[path] = rng.randrange(size)
            on.append(f"drop {path}")
        elif roll < 0.25:
            f.corrupt[path] = rng.choice([1, 2, 3, 9])
            on.append(f"corrupt {path} x{f.corrupt[path]}")
        elif roll < 0.4:
            f.status[path] = [rng.choice(STATUSES) for _ in range(rng.randint(1, 4))]
            on.append(f"status {path} {f.status[path]}")
        elif roll < 0.47:
            f.cut_every[path] = rng.randint(1, max(1, size // 3))
            on.append(f"cut every {path} at {f.cut_every[path]}")
        elif roll < 0.52:
            f.status_always[path] = rng.choice(STATUSES)
            on.append(f"always {f.status_always[path]} {path}")
        elif roll < 0.56:
            f.flood_files.add(path)
            on.append(f"flood {path}")
        elif roll < 0.59:
            f.redirect[path] = rng.choice([f"/{REPO}/resolve/main/{path}", "ftp://127.0.0.1/x", "file:///etc/passwd"])
            on.append(f"redirect {path} {f.redirect[path]}")
    if rng.random() < 0.2:
        f.ignore_range = True
        on.append("ignore range")
    if rng.random() < 0.15:
        f.wrong_range = True
        on.append("wrong range")
    if rng.random() < 0.15:
        f.listing_patch = rng.choice(HOSTILE_LISTINGS)
        on.append("hostile listing")
    if rng.random() < 0.1:
        f.no_sizes = True
        on.append("no sizes")
    return on


def check_schedule(server, tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    dest = tmp_path / "models" / "m"
    outside = tmp_path / "untouched"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    before = tree(tmp_path)
    on = random_schedule(server, rng)
    t0 = time.monotonic()
    try:
        result = download_model(REPO, dest=dest, retries=rng.randint(0, 3))
    except DownloadError as e:
        message = str(e)
        assert message and "\n" not in message and "Traceback" not in message, (on, message)
    else:
        assert result == dest and is_installed(dest), on
        assert {p: (dest / p).read_bytes() for p in WANTED} == {p: FILES[p] for p in WANTED}, on
    assert time.monotonic() - t0 < 30, on
    for path in WANTED:
        budget = download.FILE_REQUESTS_BASE + len(FILES[path]) // download.FILE_REQUEST_CREDIT_BYTES
        assert len(server.gets(path)) <= budget, (on, path, len(server.gets(path)))
    after = {k: v for k, v in tree(tmp_path).items() if not k.startswith("models/m/")}
    assert after == before, on  # nothing written or deleted outside the destination

    # A sound server afterwards: whatever the failure left (staged parts, a half state) resumes into a good model.
    server.faults = type(server.faults)()
    download_model(REPO, dest=dest)
    assert is_installed(dest) and verify_installed(dest) == [], on
    assert {p: (dest / p).read_bytes() for p in WANTED} == {p: FILES[p] for p in WANTED}, on
    assert not (dest / state.STAGING).exists()


@pytest.fixture
def quick_budgets(monkeypatch):
    monkeypatch.setattr(download, "FILE_TIME_FLOOR_S", 10.0)
    monkeypatch.setattr(download, "READ_TIMEOUT_S", 5.0)


@pytest.mark.parametrize("seed", range(15))
def test_random_fault_schedules(hub, tmp_path, quick_budgets, seed):
    check_schedule(hub, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(15, 400))
def test_random_fault_schedules_long(hub, tmp_path, quick_budgets, seed):
    check_schedule(hub, tmp_path, seed)


# --- names a server can send ------------------------------------------------------------------------------------

NAMES = settings(max_examples=500, deadline=None, derandomize=True, database=None)
name_text = st.one_of(
    st.text(max_size=60),
    st.lists(st.sampled_from(["..", ".", "", "a", "con", "x.json", "C:", "\\", "/", "\x00", "\u202e", " ", "名前"]),
             max_size=8).map("/".join),
)


@NAMES
@given(name=name_text)
def test_an_accepted_file_name_stays_inside_its_folder(tmp_path_factory, name):
    if names.name_problem(name) is not None:
        return
    assert names.traversal_problem(name) is None
    parts = name.split("/")
    assert all(p not in ("", ".", "..") for p in parts) and "\\" not in name and not name.startswith("/")
    assert all(len(p.encode("utf-8", "surrogatepass")) <= names.MAX_COMPONENT_BYTES for p in parts)
    root = tmp_path_factory.getbasetemp() / "names-root"
    root.mkdir(exist_ok=True)
    target = state.confined(root, name)
    assert target is not None and root.resolve() in target.resolve().parents


@NAMES
@given(value=st.one_of(st.text(max_size=70), st.integers(), st.none()))
def test_hashes_are_hex_of_the_right_length_or_refused(value):
    for check, length in ((names.check_sha256, 64), (names.check_git_sha1, 40)):
        try:
            out = check(value, "acme/x", "f")
        except DownloadError:
            continue
        assert len(out) == length and set(out) <= set("0123456789abcdef")


@NAMES
@given(repo=st.text(max_size=100))
def test_accepted_repo_ids_make_a_plain_folder_name(repo):
    try:
        names.check_repo_id(repo)
    except DownloadError:
        return
    folder = repo.split("/")[-1]
    assert repo.isascii() and repo.count("/") <= 1 and folder not in ("", ".", "..") and "\\" not in repo
    assert names.name_problem(folder) is None
