"""Chat sessions and GPU sampling wired into generation, on a tiny random Qwen3 (q4f16_1) with a tiny
byte-level tokenizer and chat template (tests/tiny_models.py)."""

import numpy as np
import pytest

from engine.cancel import Cancelled, CancelToken
from engine.cli import main as cli_main
from engine.errors import ContextLimitError
from engine.generate import stream_generate
from engine.model import load_model
from engine.sampling import SamplingParams, reference_probs
from engine.session import ChatSession, ChatSettings
from tests.helpers import cached_tiny_hf

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(gpu, tmp_path_factory):
    out = tmp_path_factory.mktemp("mlc") / "qwen3"
    assert cli_main(["convert", str(cached_tiny_hf("qwen3")), str(out)]) == 0
    return load_model(out, gpu=gpu, max_context=256, prefill_chunk=32)


def tokens(responses):
    return [r.token for r in responses]


def teacher_forced(model, prompt, out):
    """Logits that predicted each of `out` given everything before it."""
    model.runtime.reset()
    return model.logits(prompt + out[:-1])[len(prompt) - 1:]


def test_same_seed_same_tokens_and_seeds_differ(model):
    params = SamplingParams(temperature=1.5, seed=7)
    prompt = [5, 6, 7, 8]
    a = tokens(stream_generate(model, prompt, 30, params))
    b = tokens(stream_generate(model, prompt, 30, params))
    c = tokens(stream_generate(model, prompt, 30, SamplingParams(temperature=1.5, seed=8)))
    assert a == b and a != c


def test_every_sampled_token_passes_top_k(model):
    prompt = [9, 10, 11]
    out = tokens(stream_generate(model, prompt, 40, SamplingParams(temperature=2.0, top_k=3, seed=1)))
    logits = teacher_forced(model, prompt, out)
    rank = (logits > logits[np.arange(len(out)), out][:, None] + 1e-3 * np.abs(logits).max()).sum(1)
    assert np.all(rank < 3), rank  # prefill's first token and every decode step went through the sampler


def test_repetition_penalty_uses_the_whole_history_across_turns(model):
    params = SamplingParams(temperature=0, repetition_penalty=1.8)
    rt = model.runtime
    rt.reset()
    turn1 = [12, 13, 14, 15, 12, 13]
    out1 = tokens(stream_generate(model, turn1, 12, params))
    turn2 = turn1 + out1 + [16, 17]  # a follow-up: prefix reused, the window rebuilt from the cache
    out2 = list(stream_generate(model, turn2, 12, params))
    assert out2[0].prompt_reused > 0
    for prompt, out in ((turn1, out1), (turn2, tokens(out2))):
        logits = teacher_forced(model, prompt, out)
        for j, tok in enumerate(out):
            history = prompt + out[:j]
            probs = reference_probs(logits[j], params, history)
            best = np.flatnonzero(probs)[0]
            penalised = logits[j].astype(np.float64).copy()
            ids = np.unique(history)
            penalised[ids] = np.where(penalised[ids] < 0, penalised[ids] * 1.8, penalised[ids] / 1.8)
            assert tok == best or penalised[best] - penalised[tok] < 1e-3 * np.abs(penalised).max()


def test_chat_reuses_the_cache_across_turns(model):
    model.runtime.reset()
    chat = ChatSession(model, ChatSettings(max_tokens=8, sampling=SamplingParams(), seed=0))
    first = list(chat.send("hi"))
    assert first[-1].finish_reason in ("stop", "length")
    assert chat.messages[-1]["role"] == "assistant"
    second = list(chat.send("more"))
    assert second[0].response.prompt_reused > 10  # the first exchange came from the cache
    used = second[-1].response.context_used
    assert used == second[-1].response.prompt_tokens + second[-1].response.generation_tokens
    assert all(e.response.context_limit == 256 for e in first + second)


def test_regenerate_and_edit_roll_back(model):
    model.runtime.reset()
    chat = ChatSession(model, ChatSettings(max_tokens=6, sampling=SamplingParams(temperature=1.0), seed=3))
    one = "".join(e.answer for e in chat.send("question"))
    again = list(chat.regenerate())
    assert "".join(e.answer for e in again) == one  # fixed seed: the same reply
    assert len(chat.messages) == 2
    chat.settings.seed = None
    list(chat.send("next"))
    edited = list(chat.edit(0, "other question"))
    assert [m["content"] for m in chat.messages[:1]] == ["other question"] and len(chat.messages) == 2
    assert edited[0].response.prompt_reused > 0  # the template's header before the edit is shared


def test_refuse_policy_names_numbers_and_keeps_the_chat(model):
    chat = ChatSession(model, ChatSettings(max_tokens=64, reply_reserve=64))
    chat.messages = [{"role": "user", "content": "a" * 100}, {"role": "assistant", "content": "b" * 60}]
    before = [dict(m) for m in chat.messages]
    with pytest.raises(ContextLimitError, match=r"needs \d+ tokens plus 64 for the reply but the context holds 256"):
        chat.send("c" * 40)
    assert chat.messages == before  # the refused message was taken back; nothing else changed


def test_drop_oldest_policy_leaves_turns_out_of_the_prompt_only(model):
    chat = ChatSession(model, ChatSettings(max_tokens=8, reply_reserve=32, context_policy="drop_oldest",
                                           sampling=SamplingParams()))
    chat.messages = [{"role": "user", "content": "a" * 100}, {"role": "assistant", "content": "b" * 60}]
    events = list(chat.send("c" * 40))
    assert events[0].dropped_turns == 2 and events[-1].response.context_used <= 256
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(ContextLimitError):  # a single message that cannot fit is still refused
        chat.send("d" * 300)


def test_cancelled_reply_keeps_partial_text_and_a_consistent_cache(model):
    model.runtime.reset()
    chat = ChatSession(model, ChatSettings(max_tokens=50, sampling=SamplingParams()))
    gen = chat.send("stop me")
    partial = [next(gen) for _ in range(4)]
    gen.close()
    assert chat.messages[-1]["content"] == "".join(e.answer for e in partial)
    follow = list(chat.send("go on"))
    model.runtime.reset()
    fresh = ChatSession(model, ChatSettings(max_tokens=50, sampling=SamplingParams()),
                        messages=[dict(m) for m in chat.messages[:-2]])
    assert tokens(e.response for e in follow) == tokens(e.response for e in fresh.send("go on"))


def test_prefill_reports_progress_and_a_stop_during_it_leaves_a_cache_the_next_turn_reuses(model):
    """Stop between prefill pieces: the reply is gone (nothing produced), the cache holds exactly the prompt tokens
    it has state for, and answering again equals a fresh session token for token."""
    rt = model.runtime
    rt.reset()
    settings = ChatSettings(max_tokens=12, sampling=SamplingParams())
    token = CancelToken()
    chat = ChatSession(model, settings, cancel=token, progress=True)
    question = "tell me everything about " + "the quick brown fox " * 6
    gen = chat.send(question)
    seen = []
    with pytest.raises(Cancelled):  # the cancel lands between pieces: Cancelled, never a token
        for event in gen:
            assert event.response is None and event.answer == ""
            seen.append((event.progress.done, event.progress.total))
            if event.progress.done >= 64:
                token.cancel()
    assert seen[0][0] == 0 and seen[-1][0] >= 64 and seen[-1][0] < seen[-1][1]
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})  # strictly increasing
    assert chat.messages[-1] == {"role": "user", "content": question}
    prompt = model.tokenizer.chat_prompt(chat.messages).ids
    assert seen[-1][0] <= rt.n_cached < len(prompt) and rt.cached_ids == prompt[:rt.n_cached]


def test_stopped_prefill_then_answer_equals_a_fresh_run(model):
    rt = model.runtime
    settings = ChatSettings(max_tokens=16, sampling=SamplingParams())

    def stopped_chat() -> ChatSession:
        rt.reset()
        token = CancelToken()
        chat = ChatSession(model, settings, cancel=token, progress=True)
        with pytest.raises(Cancelled):
            for event in chat.send("a long question " * 10):
                if event.progress.done >= 32:
                    token.cancel()
        chat.cancel, chat.progress = None, False
        return chat

    chat = stopped_chat()
    prompt = model.tokenizer.chat_prompt(chat.messages).ids
    kept = rt.n_cached
    assert 32 <= kept < len(prompt)
    # The rest of the prompt read on top of what the stop kept gives the fresh run's logits (same rows, same
    # kernels: bit for bit).
    resumed = rt.logits(prompt[kept:])
    rt.reset()
    np.testing.assert_array_equal(resumed, rt.logits(prompt)[kept:])

    chat = stopped_chat()
    answer = list(chat.regenerate())
    assert answer[-1].response.prompt_reused == kept  # the pieces read before the Stop were reused
    rt.reset()
    fresh = list(ChatSession(model, settings, [dict(m) for m in chat.messages[:-1]]).regenerate())
    assert tokens(e.response for e in answer) == tokens(e.response for e in fresh)
    assert chat.messages[-1]["content"] == "".join(e.answer for e in fresh)


def test_a_stop_during_the_wait_for_a_piece_leaves_it_queued_and_the_next_turns_are_exact(model):
    """A Stop that lands while the GPU still runs a piece: the wait is abandoned at once (the piece stays queued and
    counts as read), the next reply settles the wait first, and its tokens equal a fresh run's."""

    class StopsInTheWait(CancelToken):  # pieces still start (check() passes); every fence wait sees a Stop
        @property
        def cancelled(self) -> bool:
            return True

    rt = model.runtime
    rt.reset()
    ids = list(range(3, 103))
    with pytest.raises(Cancelled):
        list(stream_generate(model, ids, 10, cancel=StopsInTheWait(), progress=True))
    assert rt.n_cached == 32 and len(rt._unsettled) == 1  # the first piece was submitted, its wait abandoned
    answer = [r for r in stream_generate(model, ids, 10, cancel=CancelToken(), progress=True) if hasattr(r, "token")]
    assert rt._unsettled == [] and answer[-1].prompt_reused == 32
    rt.reset()
    assert tokens(answer) == tokens(stream_generate(model, ids, 10))


@pytest.mark.slow
def test_cli_chat_runs_turns_and_commands(model, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    lines = iter(["hello", "/regen", "/system Be brief.", "/new", "again", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    args = ["chat", str(model.path), "--max-tokens", "5", "--temperature", "0", "--context", "128"]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert err.count("finish:") == 3 and "(system prompt set)" in err and "(new chat)" in err
    assert "context" in err and "/128" in err


@pytest.mark.slow
def test_cli_chat_reports_a_full_context_and_carries_on(model, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    lines = iter(["x" * 400, "short", ""])

    def read(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", read)
    assert cli_main(["chat", str(model.path), "--max-tokens", "4", "--context", "128"]) == 0
    err = capsys.readouterr().err
    assert "error: the conversation needs" in err and "context holds 128" in err
    assert err.count("finish:") == 1


def test_cli_ctrl_c_while_the_prompt_is_read_stops_that_reply_and_the_chat_goes_on(model, monkeypatch, capsys,
                                                                                     tmp_path):
    import signal

    from engine import cli_reply

    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    lines = iter(["tell me " + "about the fox " * 8, "short", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    update = cli_reply.PrefillMeter.update
    pressed = []

    def press_ctrl_c_once(meter, done, total, seconds):
        if done and not pressed:  # between two pieces of the first prompt
            pressed.append(done)
            signal.raise_signal(signal.SIGINT)
        update(meter, done, total, seconds)

    monkeypatch.setattr(cli_reply.PrefillMeter, "update", press_ctrl_c_once)
    args = ["chat", str(model.path), "--max-tokens", "4", "--temperature", "0", "--context", "256"]
    assert cli_main(args) == 0
    err = capsys.readouterr().err
    assert pressed and err.count("(stopped)") == 1 and err.count("finish:") == 1  # "short" was answered


def test_cli_prefill_meter_shows_reading_progress_on_a_terminal(monkeypatch):
    import io

    from engine import cli_reply

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(cli_reply, "SHOW_AFTER_S", 0.0)
    out = Terminal()
    meter = cli_reply.PrefillMeter(out)
    meter.update(0, 480, 0.0)
    meter.update(120, 480, 4.0)
    meter.finish()
    text = out.getvalue()
    assert "reading your message… 0/480 tokens" in text
    assert "reading your message… 120/480 tokens · 30 tok/s · about 12 s left" in text
    assert text.endswith("\r\033[K")  # the line makes way for the answer

