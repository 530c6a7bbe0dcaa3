"""The demo model (SmolLM2-135M-Instruct Q4_1 GGUF) for tests, installed once with the engine's own installer
into .cache/demo/models (git-ignored). A failed fetch fails the test that needs it, never skips it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.demo import install_demo

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "demo"


def demo_gguf() -> Path:
    return install_demo(CACHE / "models")


def assert_names_paris(answer: str, int8_prefill: bool) -> None:
    """The demo's greedy answer to "What is the capital of France?" names Paris with f32 prefill. With int8
    activations in the prefill GEMMs (the default wherever decode is int8) its first token is a near tie that
    swaps: transformers' own logits rank "The" 25.33 over "L" 25.24, and transformers itself, with each Linear
    input rounded to q8_1 as ours are, answers "L'Étoile, la Marseillaise, ..." as we then do. That known
    regression is recorded as an expected failure (visible in every run) instead of being tested away; any
    other answer without Paris fails."""
    if "Paris" in answer:
        return
    if int8_prefill and answer.lstrip().startswith("L"):
        pytest.xfail(f"int8 prefill swaps the demo's near-tied first answer token: {answer.strip()[:50]!r}")
    raise AssertionError(f"no Paris in {answer!r}")
