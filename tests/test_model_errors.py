"""Bad model input through the public entry points: a clear error naming the file/tensor/field, no traceback."""

import json
import shutil

import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.errors import ContextLimitError, ModelFormatError, UnsupportedModelError
from engine.model import load_model
from tests.helpers import cached_tiny_hf


@pytest.fixture(scope="module")
def good_mlc(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlc") / "phi3"
    assert cli_main(["convert", str(cached_tiny_hf("phi3")), str(out)]) == 0
    return out


@pytest.fixture
def mlc(good_mlc, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(good_mlc, dst)
    return dst


def edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


@pytest.mark.model
def test_unknown_model_type(gpu, mlc, capsys):
    edit_json(mlc / "mlc-chat-config.json", lambda c: c.update(model_type="gpt_neox"))
    with pytest.raises(UnsupportedModelError, match=r"mlc-chat-config.json.*'gpt_neox'.*supported: .*phi3"):
        load_model(mlc, gpu=gpu)
    assert cli_main(["logits", str(mlc), "--ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "gpt_neox" in err and "Traceback" not in err


@pytest.mark.model
def test_missing_config_field(gpu, mlc):
    edit_json(mlc / "mlc-chat-config.json", lambda c: c["model_config"].pop("num_hidden_layers"))
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers"):
        load_model(mlc, gpu=gpu)


@pytest.mark.model
def test_truncated_shard_via_cli(gpu, mlc, capsys):
    shard = sorted(mlc.glob("params_shard_*.bin"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert cli_main(["generate", str(mlc), "--prompt", "hi", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "Traceback" not in err


@pytest.mark.model
def test_wrong_shape_names_tensor(gpu, mlc):
    # A manifest that is self-consistent but describes the wrong shape for one tensor.
    name = "transformer.h.0.mixer.out_proj.q_scale"

    def shrink(manifest):
        for shard in manifest["records"]:
            for r in shard["records"]:
                if r["name"] == name:
                    r["shape"] = [r["shape"][0] // 2, r["shape"][1]]
                    r["nbytes"] //= 2

    edit_json(mlc / "ndarray-cache.json", shrink)
    with pytest.raises(ModelFormatError, match=rf"{name}: expected float16\[64, 2\]"):
        load_model(mlc, gpu=gpu)


@pytest.mark.model
def test_wrong_dtype_names_tensor(gpu, mlc):
    name = "transformer.norm.weight"

    def retype(manifest):
        for shard in manifest["records"]:
            for r in shard["records"]:
                if r["name"] == name:
                    r["dtype"], r["shape"] = "uint32", [r["shape"][0] // 2]

    edit_json(mlc / "ndarray-cache.json", retype)
    with pytest.raises(ModelFormatError, match=name):
        load_model(mlc, gpu=gpu)


@pytest.mark.model
def test_missing_manifest(gpu, mlc):
    (mlc / "ndarray-cache.json").unlink()
    with pytest.raises(ModelFormatError, match="ndarray-cache.json|tensor-cache.json"):
        load_model(mlc, gpu=gpu)


@pytest.mark.model
def test_cli_generate_streams_text_and_stats(gpu, good_mlc, capsys):
    assert cli_main(["generate", str(good_mlc), "--prompt", "hello", "--max-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "time to first token" in captured.err
    assert "loading" in captured.err and "(100%)" in captured.err


@pytest.mark.model
def test_load_progress_reports_every_shard(gpu, good_mlc):
    seen = []
    load_model(good_mlc, gpu=gpu, on_progress=lambda *a: seen.append(a))
    shards = {a[0] for a in seen}
    assert shards == set(range(seen[0][1]))
    assert all(a[3] <= a[4] for a in seen)


@pytest.mark.model
def test_context_limit_is_a_clear_error(gpu, good_mlc):
    model = load_model(good_mlc, gpu=gpu, max_context=32)
    with pytest.raises(ContextLimitError, match="needs 40 tokens but the context holds 32"):
        model.logits(np.arange(40) % 200)


def test_engine_imports_without_qt():
    import subprocess
    import sys

    code = ("import sys; sys.modules['PySide6'] = None; import engine, engine.model, engine.cli, "
            "engine.transformer, engine.bench; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
