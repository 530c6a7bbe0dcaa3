"""`zerotvm models / download / remove / token` end to end against the local test hub, and the offline
promise: once installed, loading and generating open no connection at all."""

import json

import pytest

from engine.cli import main as cli_main
from engine.model import load_model
from engine.sampling import SamplingParams
from tests.helpers import TINY_QWEN3_KEY as KEY
from tests.helpers import no_connections


@pytest.mark.slow
@pytest.mark.model
def test_download_list_generate_offline_and_remove(gpu, tiny_repo, capsys):
    assert cli_main(["models", "--json"]) == 0
    before = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert before[KEY]["state"] == "-" and before["qwen3-4b-q4f16_1"]["fit"] in (
        "ok", "tight", "wont_fit", "unknown", "slow", "too_slow")

    assert cli_main(["download", KEY]) == 0
    assert "(verified)" in capsys.readouterr().out
    gen = json.loads((tiny_repo / "generation_config.json").read_text())
    assert gen["do_sample"] and gen["temperature"] == 0.6 and gen["top_k"] == 20  # the catalog's defaults

    assert cli_main(["models", "--json"]) == 0
    after = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert after[KEY]["state"] == "installed"

    with no_connections(allow_loopback=False) as attempts:  # not even the local hub
        model = load_model(tiny_repo, gpu=gpu, max_context=128)
        assert model.default_sampling.temperature == 0.6
        out = list(model.generate([5, 6, 7], max_tokens=6, sampling=SamplingParams()))
    assert attempts == [] and len(out) == 6

    assert cli_main(["verify", KEY]) == 0
    assert "matches" in capsys.readouterr().out
    assert cli_main(["verify", str(tiny_repo)]) == 0  # the installed path names the same model
    assert "matches" in capsys.readouterr().out
    shard = next(tiny_repo.glob("params_shard_*.bin"))
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # one flipped byte: same size, so only the hash can tell
    shard.write_bytes(bytes(data))
    assert cli_main(["verify", KEY]) == 2
    assert "damaged file(s) removed: " + shard.name in capsys.readouterr().err and not shard.exists()
    assert cli_main(["download", KEY]) == 0 and shard.read_bytes() != bytes(data)  # fetched again, intact
    capsys.readouterr()

    assert cli_main(["remove", KEY]) == 0
    assert not tiny_repo.exists()


@pytest.mark.model
def test_download_errors_are_plain(tiny_repo, capsys, monkeypatch):
    assert cli_main(["download", "no-such-key"]) == 2
    assert "no catalog model 'no-such-key'" in capsys.readouterr().err
    assert cli_main(["download", "zerotvm-tests/missing-repo"]) == 2
    assert "no repo zerotvm-tests/missing-repo" in capsys.readouterr().err
    monkeypatch.setenv("ZEROTVM_OFFLINE", "1")
    assert cli_main(["download", KEY]) == 2
    assert "offline mode is on" in capsys.readouterr().err


def test_token_commands_use_the_keyring(memory_keyring, capsys):  # noqa: F811
    assert cli_main(["token", "status"]) == 0 and capsys.readouterr().out == "No token saved.\n"
    assert cli_main(["token", "set", "hf_secret123"]) == 0
    out = capsys.readouterr()
    assert "hf_secret123" not in out.out + out.err
    assert memory_keyring.passwords[("zerotvm", "huggingface-token")] == "hf_secret123"
    assert cli_main(["token", "status"]) == 0 and "saved" in capsys.readouterr().out
    assert cli_main(["token", "clear"]) == 0
    assert memory_keyring.passwords == {} and capsys.readouterr().out == "Token removed from the system keyring.\n"
