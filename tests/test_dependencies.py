"""pyproject's dependency lists against what the code imports: every third-party module that the tests import is
declared (a run dependency or the `test` extra), and every entry of the `test` extra is used, so README's test
command installs all the suite needs and nothing more."""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL = {"engine", "app", "tests", "bench"}  # this repository's own packages
# Entries of the test extra that no test imports, and why they are needed all the same.
USED_INDIRECTLY = {
    "pytest-qt": "a pytest plugin: the qtbot fixture",
    "accelerate": "transformers refuses to load a GGUF file (gguf_file=) without it",
    "mlx": "mlx-lm's backend; the extra names it for its [cpu] build on Linux",
}


def _name(requirement: str) -> str:
    """The normalized distribution name (PEP 503) of a requirement string."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement.strip())[0]).lower()


def _imported_by_tests() -> set[str]:
    modules = set()
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                modules.add(str(node.args[0].value).split(".")[0])
    return modules - LOCAL - set(sys.stdlib_module_names)


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow  # about 1 s: packages_distributions() reads every installed distribution's file list
def test_the_test_extra_declares_every_import_of_the_tests_and_nothing_unused():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    run = {_name(r) for r in project["dependencies"]}
    test = {_name(r) for r in project["optional-dependencies"]["test"]}
    missing = sorted(d for d in run | test if not _installed(d))
    if missing:  # e.g. the GPU machine, which carries only the wheels its test files need
        pytest.skip(f"the project is not installed with its test extra here (missing {', '.join(missing)})")
    providers = metadata.packages_distributions()
    imported = _imported_by_tests()
    undeclared = {}
    used = set()
    for module in sorted(imported):
        dists = {_name(d) for d in providers.get(module, [])}
        assert dists, f"tests import {module}, which no installed distribution provides"
        used |= dists
        if not dists & (run | test):
            undeclared[module] = sorted(dists)
    assert not undeclared, f"tests import modules that pyproject does not declare: {undeclared}"
    unused = test - used - set(USED_INDIRECTLY)
    assert not unused, f"the test extra installs {sorted(unused)}, which no test imports"
