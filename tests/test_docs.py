"""README names every ZEROTVM_* environment variable the engine and the app read: the environment is the user's
input, so each one the code reads is one the user must be able to find."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIABLE = re.compile(r"ZEROTVM_[A-Z_]+")


def test_readme_documents_every_environment_variable():
    used = {v for folder in ("engine", "app") for path in (ROOT / folder).rglob("*.py")
            for v in VARIABLE.findall(path.read_text(encoding="utf-8"))}
    documented = set(VARIABLE.findall((ROOT / "README.md").read_text(encoding="utf-8")))
    assert used, "no ZEROTVM_* variable found in the code: the pattern is wrong"
    assert not used - documented, f"read by the code but not in README: {sorted(used - documented)}"
