"""Multi-turn cache reuse: a follow-up turn prefills only new tokens and equals a fresh prefill."""

import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.errors import ContextLimitError
from engine.model import load_model
from tests.helpers import cached_tiny_hf

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(gpu, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlc") / "qwen3"
    assert cli_main(["convert", str(cached_tiny_hf("qwen3")), str(out)]) == 0
    return load_model(out, gpu=gpu, max_context=256, prefill_chunk=32)


def tokens_of(responses):
    return [r.token for r in responses]


def test_logits_after_rollback_equal_fresh_prefill(model):
    rt = model.runtime
    rng = np.random.default_rng(3)
    turn1 = rng.integers(3, 250, 70).tolist()
    turn2 = turn1[:50] + rng.integers(3, 250, 40).tolist()  # an edit: shares 50 tokens
    fresh = model.logits(turn2)
    rt.reset()
    rt.logits(turn1)
    rt.truncate(50)
    reused = rt.logits(turn2[50:])
    np.testing.assert_allclose(reused, fresh[50:], rtol=0, atol=1e-5 * np.abs(fresh).max())


def test_follow_up_turn_prefills_only_new_tokens(model):
    rt = model.runtime
    rt.reset()
    prompt1 = [5, 6, 7, 8, 9, 10, 11]
    turn1 = list(model.generate(prompt1, max_tokens=12))
    answer = tokens_of(turn1)
    assert turn1[-1].context_used == len(prompt1) + len(answer)
    prompt2 = prompt1 + answer + [20, 21, 22]
    turn2 = list(model.generate(prompt2, max_tokens=10))
    # Everything up to the last answer token (never fed back) came from the cache.
    assert turn2[0].prompt_reused == len(prompt1) + len(answer) - 1
    rt.reset()
    fresh = list(model.generate(prompt2, max_tokens=10))
    assert fresh[0].prompt_reused == 0
    assert tokens_of(turn2) == tokens_of(fresh)


def test_regenerate_rolls_back_to_the_prompt(model):
    model.runtime.reset()
    prompt = [30, 31, 32, 33]
    first = tokens_of(model.generate(prompt, max_tokens=15))
    again = list(model.generate(prompt, max_tokens=15))
    assert again[0].prompt_reused == len(prompt) - 1
    assert tokens_of(again) == first


def test_stopping_early_keeps_the_cache_consistent(model):
    rt = model.runtime
    rt.reset()
    prompt = [40, 41, 42]
    gen = model.generate(prompt, max_tokens=60)
    taken = [next(gen).token for _ in range(5)]  # the consumer stops after 5 tokens (Stop button)
    gen.close()
    assert rt.cached_ids == prompt + taken[:-1] and rt.n_cached == len(prompt) + 4
    follow = prompt + taken + [50]
    reused = list(model.generate(follow, max_tokens=5))
    rt.reset()
    assert tokens_of(reused) == tokens_of(model.generate(follow, max_tokens=5))


def test_context_limit_refuses_with_numbers_and_caps_generation(model):
    with pytest.raises(ContextLimitError, match="needs 301 tokens but the context holds 256"):
        list(model.generate(list(range(3, 303)), max_tokens=5))
    out = list(model.generate([7] * 250, max_tokens=50))
    assert out[-1].finish_reason in ("length", "stop") and out[-1].context_used <= 256
    assert all(r.context_limit == 256 for r in out)
