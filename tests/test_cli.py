"""The CLI tells the truth in plain words: MODEL is a catalog key or a path everywhere, errors say what to do,
durations read as durations, the token commands without a keyring, the software-adapter notice."""

import json
import os

import keyring
import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.errors import GpuError
from engine.gpu import AdapterInfo
from engine.humanize import human_duration, human_rate
from tests.helpers import demo_gguf

SOFTWARE = AdapterInfo(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", "CPU", "Mesa", ["shader-f16"], {})
DISCRETE = AdapterInfo(1, "NVIDIA GeForce RTX 4090", "Vulkan", "DiscreteGPU", "565.57", ["shader-f16"], {})


@pytest.fixture
def demo_home(tmp_path, monkeypatch):
    """A data folder whose models folder holds the demo model (a link to the test cache)."""
    models = tmp_path / "models"
    models.mkdir()
    gguf = demo_gguf()
    (models / gguf.name).symlink_to(gguf)
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTVM_MODELS", str(models))
    return models


def test_human_duration():
    cases = {0.0: "0 ms", 0.0124: "12 ms", 0.9994: "999 ms", 0.9996: "1.0 s", 3.24: "3.2 s", 9.96: "10 s",
             42.4: "42 s", 59.6: "1 min", 94.149: "1 min 34 s", 3599.4: "59 min 59 s", 3600: "1 h",
             7500: "2 h 5 min", None: "unknown", -1: "unknown", float("nan"): "unknown"}
    assert {s: human_duration(s) for s in cases} == cases
    assert human_rate(42.3) == "42 tokens/s" and human_rate(2.14) == "2.1 tokens/s"
    assert human_rate(0.2) == "one token every 5.0 s" and human_rate(0) == "no measurable speed"


def test_stats_line_reads_durations_as_durations():
    from types import SimpleNamespace

    from engine.cli import _stats

    r = SimpleNamespace(generation_tokens=8, generation_tps=2.1, ttft_s=94.149, prompt_tokens=37, prompt_reused=0,
                        context_used=45, context_limit=512, finish_reason="stop")
    line = _stats(r)
    assert "time to first token 1 min 34 s" in line and "ms" not in line


@pytest.mark.slow
def test_prompt_takes_a_catalog_key_or_a_path(demo_home, tmp_path, capsys):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"}]))
    assert cli_main(["prompt", str(demo_home / demo_gguf().name), "--messages", str(chat)]) == 0
    by_path = json.loads(capsys.readouterr().out)
    assert cli_main(["prompt", "smollm2-135m-demo", "--messages", str(chat)]) == 0
    assert json.loads(capsys.readouterr().out) == by_path and len(by_path) > 10


@pytest.mark.parametrize("argv,expected", [
    (["logits", "qwen3-4b-q4f16_1", "--ids", "1,2"],
     "error: Qwen3 4B (q4f16_1) is not downloaded yet; run `zerotvm download qwen3-4b-q4f16_1` first\n"),
    (["generate", "no-such-model", "--prompt", "hi"],
     "error: there is no model file, folder or catalog key called 'no-such-model'; run `zerotvm models` to see the "
     "keys, or give the path of a model folder or .gguf file\n"),
    (["prompt", "phi3-mini-4k-q4f16_1", "--messages", "chat.json"],
     "error: Phi-3 mini 4K Instruct (q4f16_1) is not downloaded yet; run `zerotvm download phi3-mini-4k-q4f16_1` "
     "first\n"),
    (["verify", "qwen3-4b-q4f16_1"],
     "error: Qwen3 4B (q4f16_1) is not downloaded, so there is nothing to verify; run `zerotvm download "
     "qwen3-4b-q4f16_1` to get it\n"),
    (["verify", "smollm2-135m-demo"],
     "error: SmolLM2 135M Instruct (demo) is checked against its SHA-256 whenever it is installed; if it looks "
     "damaged, run `zerotvm remove smollm2-135m-demo` and then `zerotvm install-demo`\n"),
    (["remove", "no-such-model"],
     "error: there is no catalog model with the key or path 'no-such-model'; run `zerotvm models` to see the keys "
     "(a file you never added is not Zero-TVM's to delete)\n"),
    (["logits", "smollm2-135m-demo", "--ids", "1,x"],
     "error: --ids must be whole numbers separated by commas, like 1,2,3 (got '1,x')\n"),
])
def test_errors_are_one_plain_sentence_with_what_to_do(tmp_path, monkeypatch, capsys, argv, expected):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTVM_MODELS", str(tmp_path / "models"))
    assert cli_main(argv) == 2
    out = capsys.readouterr()
    assert out.err == expected and out.out == ""


def test_verify_and_remove_take_the_installed_path(demo_home, capsys):
    path = demo_home / demo_gguf().name
    assert cli_main(["verify", str(path)]) == 2  # recognised as the demo, not "no such model"
    assert "SmolLM2 135M Instruct (demo) is checked" in capsys.readouterr().err
    assert cli_main(["remove", str(path)]) == 0
    assert capsys.readouterr().out == "removed SmolLM2 135M Instruct (demo)\n" and not path.exists()
    assert demo_gguf().exists()  # the link went, the cached file it pointed at stayed


def test_a_catalog_key_resolves_to_its_installed_copy(demo_home):
    from engine.library import resolve_model

    path = demo_home / demo_gguf().name
    assert resolve_model("smollm2-135m-demo") == path and resolve_model(str(path)) == path


@pytest.mark.slow
@pytest.mark.gpu
def test_logits_by_catalog_key(demo_home, tmp_path, capsys):
    out = tmp_path / "key.npy"
    assert cli_main(["logits", "smollm2-135m-demo", "--ids", "1,2,3", "--context", "64", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"saved (3, 49152) float32 logits to {out}\n"
    logits = np.load(out)
    assert logits.shape == (3, 49152) and np.isfinite(logits).all() and logits.std() > 0


def test_token_commands_without_a_keyring_claim_nothing(monkeypatch, capsys):
    from keyring.backends import fail

    monkeypatch.delenv("HF_TOKEN", raising=False)
    previous = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    try:
        assert cli_main(["token", "clear"]) == 0
        assert capsys.readouterr().out == ("Nothing to remove: this system has no keyring (password store) that "
                                           "Zero-TVM can use, so no token can have been saved there.\n")
        assert cli_main(["token", "status"]) == 0
        assert capsys.readouterr().out == ("No token saved: this system has no keyring (password store) that "
                                           "Zero-TVM can use. Set the HF_TOKEN environment variable for gated "
                                           "models.\n")
        monkeypatch.setenv("HF_TOKEN", "hf_env")
        assert cli_main(["token", "status"]) == 0
        out = capsys.readouterr().out
        assert out.endswith("HF_TOKEN is set in the environment and is used instead.\n") and "hf_env" not in out
        assert cli_main(["token", "set", "hf_abc"]) == 2
        assert "no keyring (password store)" in capsys.readouterr().err
    finally:
        keyring.set_keyring(previous)


def test_token_clear_says_whether_it_removed_one(memory_keyring, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert cli_main(["token", "set", "hf_secret123"]) == 0
    capsys.readouterr()
    assert cli_main(["token", "clear"]) == 0
    assert capsys.readouterr().out == "Token removed from the system keyring.\n"
    assert cli_main(["token", "clear"]) == 0
    assert capsys.readouterr().out == "Nothing to remove: no token is saved in the system keyring.\n"


def _fake_adapters(monkeypatch, adapters):
    import engine.gpu

    monkeypatch.setattr(engine.gpu, "list_adapters", lambda: adapters)
    monkeypatch.setenv("ZEROTVM_ADAPTER", "")  # "" = automatic


def test_gpus_and_models_name_a_software_adapter(monkeypatch, tmp_path, capsys):
    from engine.speed import DEMO_DECODE_BYTES, software_tps

    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setattr("engine.speed.cores", lambda: 2)  # the estimate scales with cores: the CI machine's count
    _fake_adapters(monkeypatch, [SOFTWARE])
    assert cli_main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "* [0] llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan, CPU, Mesa)  (software GPU: runs on the processor)" in out
    assert f"Expect roughly {human_rate(software_tps(DEMO_DECODE_BYTES))} from the demo model" in out

    assert cli_main(["models", "--json"]) == 0
    captured = capsys.readouterr()
    rows = {r["key"]: r for r in json.loads(captured.out)}
    assert "software GPU" in captured.err
    big = rows["qwen3.6-35b-a3b-mlx-4bit"]
    assert big["fit"] in ("too_slow", "wont_fit") and "too slow" in big["fit_summary"]  # never "ok"
    assert rows["smollm2-135m-demo"]["fit"] in ("slow", "tight", "wont_fit") and rows["smollm2-135m-demo"][
        "tokens_per_s"] == pytest.approx(software_tps(DEMO_DECODE_BYTES), rel=0.01)

    from engine.speed import record_decode

    record_decode(SOFTWARE.key, DEMO_DECODE_BYTES, 40, 7.5)  # the app timed a reply here: its speed is quoted
    assert cli_main(["gpus"]) == 0
    assert "Expect roughly 7.5 tokens/s from the demo model and far slower replies from bigger models (measured on " \
        "this computer)" in capsys.readouterr().out
    assert cli_main(["models", "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["smollm2-135m-demo"]["tokens_per_s"] == pytest.approx(7.5, rel=1e-3)

    _fake_adapters(monkeypatch, [DISCRETE])
    assert cli_main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "software" not in out and out.startswith("* [1] NVIDIA GeForce RTX 4090")
    assert cli_main(["models", "--json"]) == 0
    captured = capsys.readouterr()
    assert "software" not in captured.err
    assert all(r["tokens_per_s"] is None and "slow" not in r["fit"] for r in json.loads(captured.out))


def test_models_gives_one_memory_sentence_per_model(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    for adapter in (SOFTWARE, DISCRETE):
        _fake_adapters(monkeypatch, [adapter])
        assert cli_main(["models", "--json"]) == 0
        for r in json.loads(capsys.readouterr().out):
            message = r["fit_message"]
            # One sentence says what it needs and what is free; the catalog's own "Needs about" is not repeated.
            assert message.count(" needs ") == 1 and "Needs about" not in message, message
            assert message.count(" is free") == 1, message


def test_file_errors_and_adapter_choice_in_plain_words(demo_home, monkeypatch, capsys):
    assert cli_main(["prompt", "smollm2-135m-demo", "--messages", "/no/such/chat.json"]) == 2
    err = capsys.readouterr().err
    assert err == "error: there is no such file or folder: /no/such/chat.json; check the path and try again\n"
    _fake_adapters(monkeypatch, [DISCRETE])
    assert cli_main(["--adapter", "no-such-gpu", "gpus"]) == 0  # the list still prints; why none is chosen, too
    out = capsys.readouterr()
    assert out.out.startswith("  [1] NVIDIA GeForce RTX 4090") and out.err.startswith(
        "No adapter chosen: no GPU adapter matches 'no-such-gpu' (adapters found: [1] NVIDIA")
    assert "leave it unset to pick the fastest" in out.err
    # --adapter reaches the engine's later Gpu() choices without writing the environment.
    from engine.gpu import pick_adapter

    assert os.environ["ZEROTVM_ADAPTER"] == ""
    with pytest.raises(GpuError, match="no GPU adapter matches 'no-such-gpu'"):
        pick_adapter()


def test_generate_and_chat_say_what_speed_to_expect_on_a_software_gpu(demo_home, capsys):
    from engine.cli import _software_note
    from engine.speed import DEMO_DECODE_BYTES, software_tps

    _software_note(SOFTWARE, str(demo_home / demo_gguf().name))
    err = capsys.readouterr().err
    assert err == (f"Running on {SOFTWARE.name}, a software GPU (the processor does the graphics card's work): expect "
                   f"roughly {human_rate(software_tps(DEMO_DECODE_BYTES))} from SmolLM2 135M Instruct (demo) (a rough "
                   "estimate). `zerotvm gpus` says how to get full speed.\n")
    _software_note(DISCRETE, str(demo_home / demo_gguf().name))
    assert capsys.readouterr().err == ""


def test_bench_options_reach_the_runtime_options(monkeypatch, capsys):
    """`bench --options JSON` passes RuntimeOptions fields through to run_bench (an A/B of a decode variant); not an
    object, bad JSON or an unknown name is a plain error."""
    import engine.bench
    from engine.runtime_options import RuntimeOptions

    seen = {}

    def fake_run_bench(shape, decode_tokens, prompt_tokens, runs, long_prompt, timestamps, **runtime_options):
        seen.update(shape=shape, options=RuntimeOptions.of(**runtime_options))  # as run_bench builds them
        return {"table": "ok"}

    monkeypatch.setattr(engine.bench, "run_bench", fake_run_bench)
    assert cli_main(["bench", "--shape", "qwen3-4b", "--options", '{"gate_up_q8": true}']) == 0
    assert seen["shape"] == "qwen3-4b" and seen["options"].gate_up_q8 is True
    assert capsys.readouterr().out.strip() == "ok"
    for bad, said in (("[1]", "JSON object"), ('{"gate_up_q8": }', "Expecting value"), ('{"nope": 1}', "nope")):
        assert cli_main(["bench", "--options", bad]) == 2
        assert said in capsys.readouterr().err
