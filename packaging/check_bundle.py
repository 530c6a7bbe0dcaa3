"""Check a PyInstaller one-folder bundle: its size against a budget, and that no test-only package got in.

    python packaging/check_bundle.py dist/zerotvm-chat --budget-mb 250

Looks at every file in the folder and at every module inside the programs' PYZ archives (pure-Python packages
live only there), so a stray `import pytest` is caught as surely as torch's shared libraries. Exit status 1 on
a violation. PyInstaller is needed only to read the archives (it is there whenever a bundle was just built).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

FORBIDDEN = ("torch", "transformers", "accelerate", "mlx", "mlx_lm", "pytest", "_pytest", "pytestqt",
             "pytest_qt", "IPython", "matplotlib", "scipy", "pandas", "tkinter", "_tkinter")
FORBIDDEN_LIBS = (("libtorch", "torch"), ("libc10", "torch"), ("libmlx", "mlx"))


def forbidden_name(name: str) -> str | None:
    """The forbidden package a file, folder or top-level module name belongs to: `torch`, `torch.libs`,
    `torch-2.13.0.dist-info`, `libtorch_cpu.so`, `_tkinter.cpython-311-x86_64-linux-gnu.so`... and None for
    everything else (`libscipy_openblas64_.so` is numpy's BLAS, not scipy)."""
    for bad in FORBIDDEN:
        if name == bad or name.startswith((bad + "-", bad + ".")):
            return bad
    for lib, bad in FORBIDDEN_LIBS:
        if name.startswith(lib):
            return bad
    return None


def bundle_files(folder: Path) -> list[Path]:
    return [Path(d) / f for d, _, files in os.walk(folder) for f in files]


def bundle_bytes(folder: Path) -> int:
    """Bytes of the regular files (symlinks, which PyInstaller makes for Qt libraries, are not counted twice)."""
    return sum(p.lstat().st_size for p in bundle_files(folder) if not p.is_symlink())


def archive_modules(program: Path) -> list[str]:
    from PyInstaller.archive.readers import pkg_archive_contents

    return pkg_archive_contents(str(program), recursive=True)


def programs(folder: Path) -> list[Path]:
    """The executables PyInstaller wrote next to _internal/ (with their PKG archive appended)."""
    found = []
    for p in folder.iterdir():
        if p.is_file() and (p.suffix == ".exe" or (os.name != "nt" and os.access(p, os.X_OK))):
            found.append(p)
    return found


def check(folder: Path, budget_mb: float) -> list[str]:
    problems = []
    size = bundle_bytes(folder)
    print(f"bundle {folder}: {size / 1e6:.1f} MB in {len(bundle_files(folder))} files (budget {budget_mb:.0f} MB)")
    if size > budget_mb * 1e6:
        problems.append(f"bundle is {size / 1e6:.1f} MB, over the {budget_mb:.0f} MB budget")
    for path in bundle_files(folder):
        for part in path.relative_to(folder).parts:
            bad = forbidden_name(part)
            if bad:
                problems.append(f"{bad}: file {path.relative_to(folder)}")
                break
    exes = programs(folder)
    if not exes:
        problems.append(f"no programs found in {folder}")
    for exe in exes:
        modules = archive_modules(exe)
        print(f"{exe.name}: {len(modules)} archived modules")
        for mod in modules:
            bad = forbidden_name(mod.split(".")[0])
            if bad:
                problems.append(f"{bad}: module {mod} in {exe.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the one-folder bundle, e.g. dist/zerotvm-chat")
    p.add_argument("--budget-mb", type=float, default=250.0)
    args = p.parse_args(argv)
    problems = check(args.folder, args.budget_mb)
    for line in problems[:50]:
        print(f"FAIL {line}", file=sys.stderr)
    if len(problems) > 50:
        print(f"... and {len(problems) - 50} more", file=sys.stderr)
    if not problems:
        print("bundle OK: within budget, no test-only packages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
