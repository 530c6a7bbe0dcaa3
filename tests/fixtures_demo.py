"""The demo model (SmolLM2-135M-Instruct Q4_1 GGUF) for tests, installed once with the engine's own installer
into .cache/demo/models (git-ignored). A failed fetch fails the test that needs it, never skips it."""

from __future__ import annotations

from pathlib import Path

from engine.demo import install_demo

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "demo"


def demo_gguf() -> Path:
    return install_demo(CACHE / "models")

