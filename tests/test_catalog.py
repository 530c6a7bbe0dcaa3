"""Model catalog (resources/models.json) and models added from disk (engine/catalog.py, engine/local_models.py).

The catalog's derived numbers are checked against the architecture: KV bytes per token from the dims, and
for the dense MLC models the exact q4f16_1 weight bytes from the runtime's blocks (engine/transformer.py
expected_tensors).
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from engine import demo
from engine.catalog import (
    add_local,
    all_models,
    catalog_path,
    demo_matches,
    entry,
    install_dir,
    load_catalog,
    load_local,
    remove_local,
)
from engine.errors import ModelFormatError
from engine.formats.mlc import MlcCheckpoint
from engine.transformer import expected_tensors
from tests.helpers import DIMS, cached_tiny_hf, demo_gguf, make_model, q4_k_m_formats, spec_from_dims

NOT_FOUND = "not found offline; the first download pins the commit the hub resolves"


@pytest.fixture(scope="module")
def catalog():
    return {e.key: e for e in load_catalog()}


def by_repo(catalog, repo):
    return next(e for e in catalog.values() if e.repo == repo)


def raw_catalog():
    return json.loads(catalog_path().read_text(encoding="utf-8"))


# ---- the bundled catalog ---------------------------------------------------------------------------
def test_catalog_lists_the_issue_models(catalog):
    repos = {e.repo for e in catalog.values()}
    assert {"mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC", "mlc-ai/Qwen3-4B-q4f16_1-MLC",
            "mlc-ai/Qwen3.5-4B-q4f16_1-MLC", "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit",
            "abgunaydin/Qwen3.6-35B-A3B-MLX-q3exp", *GGUF_BUILDS} <= repos
    assert [e.key for e in catalog.values() if e.is_demo] == ["smollm2-135m-demo"]
    assert len(catalog) == len(raw_catalog()["models"])  # keys unique (the loader also refuses duplicates)


def test_every_entry_says_where_its_facts_came_from(catalog):
    for e in catalog.values():
        for text in (e.name, e.architecture, e.revision_source, e.size_source, e.generation_source, e.license):
            assert text.strip(), e.key
        assert e.files and all(e.files)
        assert e.weights_bytes > 0 and e.largest_tensor_bytes < e.weights_bytes
        assert 0 < e.default_context <= e.max_context
        if e.revision is None:
            assert e.is_demo or e.revision_source.startswith(NOT_FOUND), e.key
        else:
            assert re.fullmatch(r"[0-9a-f]{40}", e.revision)
        if e.size_approximate:
            assert "approximate" in e.size_source or "not counted" in e.size_source or "third-party" in e.size_source


def test_formats_architectures_and_what_runs(catalog):
    expected = {  # repo -> (format, model_type, runs)
        "mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC": ("mlc", "phi3", True),
        "mlc-ai/Qwen3-4B-q4f16_1-MLC": ("mlc", "qwen3", True),
        "mlc-ai/Qwen3.5-4B-q4f16_1-MLC": ("mlc", "qwen3_5", True),
        "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit": ("mlx", "qwen3_5_moe", True),
        "abgunaydin/Qwen3.6-35B-A3B-MLX-q3exp": ("mlx", "qwen3_5_moe", True),
    }
    for repo, (fmt, arch, runs) in expected.items():
        e = by_repo(catalog, repo)
        assert (e.format, e.architecture, e.runs) == (fmt, arch, runs), repo
        assert (e.runs_reason is None) == runs
    d = catalog["smollm2-135m-demo"]
    assert (d.format, d.architecture, d.runs) == ("gguf", "llama", True)


def test_kv_bytes_per_token_follow_the_architecture(catalog):
    assert by_repo(catalog, "mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC").kv_bytes_per_token == 2 * 32 * 32 * 96 * 2
    assert by_repo(catalog, "mlc-ai/Qwen3-4B-q4f16_1-MLC").kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    # Hybrids: only the full-attention layers keep a KV cache (8 of 32, 10 of 40).
    assert by_repo(catalog, "mlc-ai/Qwen3.5-4B-q4f16_1-MLC").kv_bytes_per_token == 2 * 8 * 4 * 256 * 2
    for repo in ("lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit", "abgunaydin/Qwen3.6-35B-A3B-MLX-q3exp"):
        assert by_repo(catalog, repo).kv_bytes_per_token == 2 * 10 * 2 * 256 * 2
    assert catalog["smollm2-135m-demo"].kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_dense_mlc_weight_bytes_are_exact(catalog):
    for e in catalog.values():
        if e.format != "mlc" or not e.runs or "linear_attention" in e.dims:  # hybrids: the test below
            continue
        sizes = [int(np.prod(s)) * np.dtype(t).itemsize for s, t in expected_tensors(spec_from_dims(e)).values()]
        assert e.weights_bytes == sum(sizes), e.key
        assert e.largest_tensor_bytes == max(sizes), e.key
        assert not e.weights_approximate


def test_hybrid_mlc_weight_bytes_are_exact(catalog):
    e = by_repo(catalog, "mlc-ai/Qwen3.5-4B-q4f16_1-MLC")
    spec = spec_from_dims(e)
    sizes = {n: int(np.prod(s)) * np.dtype(t).itemsize for n, (s, t) in expected_tensors(spec).items()}
    assert e.weights_bytes == sum(sizes.values()) and e.largest_tensor_bytes == max(sizes.values())
    # The shards store A_log / dt_bias as bf16 records: exactly the third-party download size.
    assert e.total_bytes == sum(n // 2 if k.endswith(("A_log", "dt_bias")) else n for k, n in sizes.items())
    assert not e.weights_approximate


GGUF_BUILDS = {  # repo: (key, model_type, MLC sibling with the same architecture)
    "Qwen/Qwen3-4B-GGUF": ("qwen3-4b-q4_k_m-gguf", "qwen3", "qwen3-4b-q4f16_1"),
    "microsoft/Phi-3-mini-4k-instruct-gguf": ("phi3-mini-4k-q4_k_m-gguf", "phi3", "phi3-mini-4k-q4f16_1"),
    "bartowski/Phi-3.5-mini-instruct-GGUF": ("phi3.5-mini-q4_k_m-gguf", "phi3", "phi3-mini-4k-q4f16_1"),
    "bartowski/Llama-3.2-3B-Instruct-GGUF": ("llama3.2-3b-q4_k_m-gguf", "llama", None),
}


def test_gguf_builds_are_pinned_single_files_of_the_q4_k_m_mix(catalog):
    for repo, (key, model_type, sibling) in GGUF_BUILDS.items():
        e = catalog[key]
        assert (e.repo, e.format, e.architecture, e.runs, e.source) == (repo, "gguf", model_type, True, "huggingface")
        assert len(e.files) == 1 and e.files[0].endswith(".gguf") and re.fullmatch(r"[0-9a-f]{64}", e.sha256)
        assert e.revision and not e.size_approximate and e.weights_approximate
        if sibling:
            assert e.dims == catalog[sibling].dims
        d = e.dims  # rows of whole 256-element blocks everywhere: no Q5_0 / Q8_0 fallback applies
        assert all(k % 256 == 0 for k in (d["hidden_size"], d["ffn_dim"], d["num_heads"] * d["head_dim"]))
        sizes = [int(np.prod(s)) * np.dtype(t).itemsize
                 for s, t in expected_tensors(spec_from_dims(e), q4_k_m_formats(e)).values()]
        assert (e.weights_bytes, e.largest_tensor_bytes) == (sum(sizes), max(sizes)), key
        # The file is those tensors (norms as F32, twice their f16 upload) and its metadata: a tokenizer's few MB.
        assert 0 < e.total_bytes - e.weights_bytes < 10_000_000, key


def test_generation_defaults(catalog):
    qwen3 = by_repo(catalog, "mlc-ai/Qwen3-4B-q4f16_1-MLC").generation
    assert qwen3 == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
    assert by_repo(catalog, "mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC").generation["temperature"] == 0  # greedy


def test_qwen36_builds_carry_a_ram_warning(catalog):
    q3 = by_repo(catalog, "abgunaydin/Qwen3.6-35B-A3B-MLX-q3exp")
    q4 = by_repo(catalog, "lmstudio-community/Qwen3.6-35B-A3B-MLX-4bit")
    assert (q3.ram_warning_bytes, q4.ram_warning_bytes) == (20_000_000_000, 24_000_000_000)
    assert "20 GB" in q3.ram_warning and "24 GB" in q4.ram_warning
    assert all(e.ram_warning_bytes is None for e in catalog.values() if e.architecture != "qwen3_5_moe")


def test_demo_entry_matches_engine_demo(catalog):
    d = catalog["smollm2-135m-demo"]
    assert demo_matches(d)
    assert (d.files, d.total_bytes, d.sha256, d.package) == ([demo.FILE_NAME], demo.FILE_SIZE, demo.FILE_SHA256,
                                                               demo.PACKAGE)
    assert d.source == "pypi" and d.repo is None


@pytest.mark.slow
def test_demo_entry_matches_the_gguf_itself(catalog, tmp_path):
    # What add_local reads from the real file must agree with what the catalog says about it.
    seen = add_local(demo_gguf(), tmp_path / "local.json")
    d = catalog["smollm2-135m-demo"]
    assert (seen.weights_bytes, seen.largest_tensor_bytes, seen.dims, seen.kv_bytes_per_token, seen.max_context) == (
        d.weights_bytes, d.largest_tensor_bytes, d.dims, d.kv_bytes_per_token, d.max_context)
    assert seen.generation == d.generation and seen.license.lower() == d.license.lower()


def test_entry_and_install_dir(catalog, tmp_path):
    qwen = entry("qwen3-4b-q4f16_1", local=tmp_path / "none.json")
    assert install_dir(qwen, tmp_path) == tmp_path / "qwen3-4b-q4f16_1"
    assert install_dir(catalog["smollm2-135m-demo"], tmp_path) == tmp_path  # engine.demo puts the file here
    with pytest.raises(KeyError, match="no model 'nope'"):
        entry("nope", local=tmp_path / "none.json")


# ---- malformed catalogs -----------------------------------------------------------------------------
def write_catalog(tmp_path, edit) -> Path:
    data = raw_catalog()
    edit(data["models"])
    path = tmp_path / "models.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize("edit, field", [
    (lambda m: m[0].pop("kv_bytes_per_token"), "kv_bytes_per_token"),
    (lambda m: m[1].update(weights_bytes="2 GB"), "weights_bytes"),
    (lambda m: m[0].update(revision="main"), "revision"),
    (lambda m: m[0].update(format="safetensors"), "format"),
    (lambda m: m[0].update(kv_bytes_per_token=12345), "kv_bytes_per_token"),
    (lambda m: m[0]["dims"].pop("head_dim"), "dims.head_dim"),
    (lambda m: m[2].update(runs=False, runs_reason=None), "runs_reason"),
    (lambda m: m[0].update(key="Phi 3"), "key"),
    (lambda m: m[0].update(colour="blue"), "colour"),
    (lambda m: m[1].update(key=m[0]["key"]), "key"),
    (lambda m: m[0].update(file_type="Q4_K_M"), "file_type"),  # an MLC build has none
    (lambda m: next(e for e in m if e["format"] == "gguf").update(file_type="IQ2_XS"), "file_type"),
])
def test_malformed_catalog_names_the_file_and_field(tmp_path, edit, field):
    path = write_catalog(tmp_path, edit)
    with pytest.raises(ModelFormatError, match=re.escape(f"field '{field}'")) as err:
        load_catalog(path)
    assert str(path) in str(err.value)


def test_unreadable_catalog(tmp_path):
    path = tmp_path / "models.json"
    path.write_text("{ not json", encoding="utf-8")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        load_catalog(path)
    path.write_text('{"models": {}}', encoding="utf-8")
    with pytest.raises(ModelFormatError, match="field 'models'"):
        load_catalog(path)


# ---- local models -----------------------------------------------------------------------------------
def test_add_local_gguf(tmp_path, rng):
    model, _, _ = make_model(tmp_path, rng, "llama")
    store = tmp_path / "local.json"
    e = add_local(model, store)
    assert (e.format, e.architecture, e.source, e.runs, e.path) == ("gguf", "llama", "local", True, str(model))
    d = e.dims
    assert (d["hidden_size"], d["num_layers"], d["num_kv_heads"], d["head_dim"]) == (
        DIMS["dim"], DIMS["layers"], DIMS["kv_heads"], DIMS["head_dim"])
    assert e.kv_bytes_per_token == 2 * DIMS["layers"] * DIMS["kv_heads"] * DIMS["head_dim"] * 2
    assert e.total_bytes == model.stat().st_size and e.weights_bytes > 0
    assert install_dir(e) == model
    assert load_local(store) == [e]
    assert e in all_models(local=store)


@pytest.mark.model
def test_add_local_mlc_folder_and_hf_folder(tmp_path):
    from engine.cli import main

    hf = cached_tiny_hf("llama")
    out = tmp_path / "tiny-mlc"
    main(["convert", str(hf), str(out)])
    store = tmp_path / "local.json"
    mlc = add_local(out, store)
    ckpt = MlcCheckpoint(out)
    assert (mlc.format, mlc.architecture, mlc.runs) == ("mlc", "llama", True)
    assert mlc.weights_bytes == sum(ckpt.record(n).nbytes for n in ckpt.names())
    cfg = json.loads((hf / "config.json").read_text())
    assert mlc.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    # The unconverted checkpoint is listed too, but not runnable, and says what to do.
    raw = add_local(hf, store)
    assert (raw.format, raw.runs) == ("hf", False) and "zerotvm convert" in raw.runs_reason
    assert raw.weights_approximate
    assert {e.key for e in load_local(store)} == {mlc.key, raw.key}


def test_local_persistence_round_trip(tmp_path, rng):
    store = tmp_path / "data" / "local.json"
    a = add_local(make_model(tmp_path, rng, "llama")[0], store)
    (tmp_path / "b").mkdir()
    b = add_local(make_model(tmp_path / "b", rng, "qwen3")[0], store)
    assert a.key != b.key
    assert add_local(a.path, store) == a  # adding again replaces, never duplicates
    assert [e.key for e in load_local(store)] == [b.key, a.key]
    assert remove_local(a.key, store) is True
    assert remove_local(a.key, store) is False
    assert load_local(store) == [b]
    assert not list(store.parent.glob("*.tmp"))  # written through a temporary file, renamed into place


def test_broken_local_list_is_kept_aside(tmp_path, rng):
    store = tmp_path / "local.json"
    store.write_text("{ half a file", encoding="utf-8")
    assert load_local(store) == []
    assert (tmp_path / "local.json.bad").read_text(encoding="utf-8") == "{ half a file"
    e = add_local(make_model(tmp_path, rng, "llama")[0], store)
    assert load_local(store) == [e]
    store.write_text(json.dumps({"models": [{"key": "x"}]}), encoding="utf-8")  # valid JSON, bad entry
    assert load_local(store) == []
    assert json.loads((tmp_path / "local.json.bad").read_text(encoding="utf-8")) == {"models": [{"key": "x"}]}


def test_add_local_errors_name_the_file(tmp_path):
    store = tmp_path / "local.json"
    with pytest.raises(ModelFormatError, match="not found"):
        add_local(tmp_path / "missing", store)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match=re.escape(str(tmp_path / "empty")) + ".*mlc-chat-config.json"):
        add_local(tmp_path / "empty", store)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFormatError, match=re.escape(str(junk))):
        add_local(junk, store)
    broken = tmp_path / "broken-mlc"
    broken.mkdir()
    (broken / "mlc-chat-config.json").write_text("{", encoding="utf-8")
    with pytest.raises(ModelFormatError, match=re.escape(str(broken / "mlc-chat-config.json"))):
        add_local(broken, store)
    hf = tmp_path / "no-layers"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "mystery", "hidden_size": 64}), encoding="utf-8")
    (hf / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(ModelFormatError, match=re.escape(str(hf / "config.json")) + ".*num_attention_heads"):
        add_local(hf, store)
    assert not store.exists()  # nothing was recorded


def safetensors_tensor_bytes(folder: Path) -> int:
    """The tensor bytes of a folder's safetensors shards, from their headers (what a download holds beyond them is
    the headers themselves)."""
    import struct

    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


@pytest.mark.parametrize("variant, bits", [("q4", 4), ("q3exp", 3)])
def test_qwen36_text_bytes_rule_is_what_mlx_lm_writes(variant, bits):
    """bench/catalog_sizes.py's rule (the architecture's weight table, stored as mlx-lm quantizes it) against a
    checkpoint mlx-lm itself wrote, for a tiny config of the same architecture: every byte."""
    from bench.catalog_sizes import text_bytes
    from tests.helpers import cached_mlx

    folder = cached_mlx(variant)
    config = json.loads((folder / "config.json").read_text())["text_config"]
    assert text_bytes(bits, config)[0] == safetensors_tensor_bytes(folder)


@pytest.mark.parametrize("key, bits", [("qwen3.6-35b-a3b-mlx-4bit", 4), ("qwen3.6-35b-a3b-mlx-q3", 3)])
def test_qwen36_catalog_sizes_are_the_text_tensors_plus_the_vision_tower(catalog, key, bits):
    """The catalog's download size is re-derived from the tensor list: the text tensors (its weights_bytes, what
    memfit plans) plus the vision tower the shards carry and the runtime never reads."""
    from bench.catalog_sizes import text_bytes, vision_bytes

    e = catalog[key]
    text, experts = text_bytes(bits)
    assert e.weights_bytes == text and e.total_bytes == text + vision_bytes()
    assert f"{vision_bytes():,} bytes bf16" in e.size_source and f"routed experts {experts:,}" in e.size_source
    assert e.size_approximate  # the shard headers and the index are not counted
