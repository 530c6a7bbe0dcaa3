"""bench/gguf_standin.py: the stand-in files bench/load_peak.py loads for the catalog's GGUF builds are what the real
files are to the loader (names, shapes, GGML types, config), their weights are the bytes memfit counts, and they load
and run; bench/load_peak.py reports a stand-in's catalog and file predictions side by side."""

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGUFReader

from bench import gguf_standin as s
from engine import memfit
from engine.catalog import load_catalog
from engine.formats.gguf import GgufCheckpoint
from engine.memfit_stream import entry_formats
from engine.model import load_model
from engine.models import model_module
from tests.helpers import demo_gguf, q4_k_m_formats

CATALOG = {e.key: e for e in load_catalog()}
Q4_K_M = sorted(k for k in s.STANDINS if s.STANDINS[k]["mix"] == "q4_k_m")
ROPE = {"qwen3-4b-q4_k_m-gguf": None, "phi3-mini-4k-q4_k_m-gguf": None, "phi3.5-mini-q4_k_m-gguf": "longrope",
        "llama3.2-3b-q4_k_m-gguf": "gguf_freq_factors"}  # what the real files' RoPE tensors make of the config


def table(path) -> dict:
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in GGUFReader(path).tensors}


def file_spec(ckpt: GgufCheckpoint):
    module = model_module(ckpt.model_type)
    return module.spec(module.ModelArgs.from_dict(ckpt.config))


def test_every_catalog_gguf_build_has_a_stand_in():
    assert set(s.STANDINS) == {k for k, e in CATALOG.items() if e.format == "gguf"}


@pytest.mark.slow  # reading the real file's header (its tokenizer arrays) takes seconds
def test_the_demo_stand_in_is_the_real_files_layout(tmp_path):
    # The demo's real file is at hand: every tensor's name, type and shape, and the config the reader builds from the
    # header, are the stand-in's (less the token ids, which come with the tokenizer the stand-in leaves out).
    e = CATALOG["smollm2-135m-demo"]
    path = s.write(e, tmp_path / "demo.gguf", fill=False)
    assert table(path) == table(demo_gguf())
    ours, real = GgufCheckpoint(path).config, GgufCheckpoint(demo_gguf()).config
    assert {k: v for k, v in real.items() if not k.endswith("_token_id")} == ours
    assert s.uploaded_bytes(e) == e.weights_bytes
    formats, mix = GgufCheckpoint(demo_gguf()).runtime_formats(), entry_formats(e, None)  # memfit's from file_type
    assert {n: formats[n] for n in mix} == mix and {formats[n] for n in set(formats) - set(mix)} == {"f16"}


@pytest.mark.parametrize("key", Q4_K_M)
def test_q4_k_m_stand_ins_are_the_catalogs_builds(tmp_path, key):
    # Written as a sparse file (the layout without the bytes): the loader's formats are the Q4_K_M mix the catalog
    # derived its weight figure from (tests/test_catalog.py), the config its dims, and the weight bytes agree three
    # ways: the stand-in's tensors, the catalog's figure (what memfit predicts a catalog entry with), and memfit's
    # plan of the file.
    e = CATALOG[key]
    path = s.write(e, tmp_path / f"{key}.gguf", fill=False)
    ckpt = GgufCheckpoint(path)
    formats = ckpt.runtime_formats()
    mix = q4_k_m_formats(e)
    assert {n: formats[n] for n in mix} == mix
    assert {formats[n] for n in set(formats) - set(mix)} == {"f16"}  # the norms, F32 in the file
    d, cfg = e.dims, ckpt.config
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"], cfg["tie_word_embeddings"],
            cfg["max_position_embeddings"]) == (d["hidden_size"], d["num_layers"], d["num_heads"], d["num_kv_heads"],
                                                d["head_dim"], d["ffn_dim"], d["vocab_size"], d["tied_embeddings"],
                                                e.max_context)
    assert (cfg["rope_scaling"] or {}).get("rope_type") == ROPE[key]
    plan = memfit.estimate(file_spec(ckpt), e.default_context, formats=formats)
    assert s.uploaded_bytes(e) == e.weights_bytes == memfit.estimate(e).weights_bytes == plan.weights_bytes
    catalog = memfit.estimate(e)  # planned from the catalog's file_type: the file's buffers, to the byte
    assert (catalog.gpu_bytes, catalog.load_gpu_bytes) == (plan.gpu_bytes, plan.load_gpu_bytes)
    # the file is its header plus every tensor's bytes, each padded to the 32-byte alignment
    tensors = GGUFReader(path).tensors
    assert path.stat().st_size == int(tensors[-1].data_offset) + int(tensors[-1].n_bytes)
    assert sum(int(t.n_bytes) for t in tensors) == sum(s.tensor_bytes(*v) for v in s.layout(e).values())


def shrunk(key: str):
    """The catalog entry with small dims (rows of whole 256-blocks, 8 layers: use_more_bits picks 0, 3, 6, 7)."""
    e = CATALOG[key]
    heads, kv = (4, 4) if e.architecture == "phi3" else (4, 2)
    return dataclasses.replace(e, dims=dict(e.dims, hidden_size=256, num_layers=8, num_heads=heads, num_kv_heads=kv,
                                            head_dim=64, ffn_dim=512, vocab_size=512, kv_layers=8))


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(s.STANDINS))
def test_shrunken_stand_ins_load_and_run_finite(gpu, tmp_path, key):
    # Every type mix and RoPE variant through load_model on lavapipe: the random blocks pass the reader's checks and
    # one prefill through random layers stays finite. Written once: a second ensure finds it.
    e = shrunk(key)
    path, _ = s.ensure(e, tmp_path)
    assert s.ensure(e, tmp_path) == (path, 0.0)
    model = load_model(path, gpu=gpu, max_context=64)
    kinds = {t for t, _ in table(path).values()}
    assert kinds == ({"F32", "Q8_0", "Q4_1"} if key == "smollm2-135m-demo" else
                     {"F32", "Q4_K", "Q6_K", "Q5_K"} if e.architecture == "phi3" else {"F32", "Q4_K", "Q6_K"})
    logits = model.logits(np.arange(16) % 512)
    assert logits.shape == (16, 512) and np.isfinite(logits).all() and logits.std() > 0


class FakeMemory:
    """UsedMemory without NVML: a count that grows with each read."""

    source = "fake"

    def __init__(self):
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n << 20


@pytest.mark.slow
def test_load_peak_reports_a_stand_in_beside_the_catalogs_prediction(gpu, tmp_path, monkeypatch):
    from bench import load_peak
    from engine import catalog

    e = shrunk("llama3.2-3b-q4_k_m-gguf")
    monkeypatch.setattr(catalog, "load_catalog", lambda: [e])
    monkeypatch.setattr(s, "CACHE", tmp_path)
    monkeypatch.setattr(load_peak, "UsedMemory", FakeMemory)
    assert not s.path_for(e, tmp_path).exists()
    out = load_peak.one(e.key, None, 64, None)
    assert out["checkpoint"] == str(s.path_for(e, tmp_path)) and out["context"] == 64  # written, then loaded
    assert out["predicted_by_kind_gb"]["weights"] == round(e.weights_bytes / 1e9, 3)  # the catalog's figure
    # the shrunken dims, not the catalog's weight figure: the report says so, with the three numbers
    assert out["weights_bytes"]["stand_in_tensors"] == out["weights_bytes"]["file_plan"] == s.uploaded_bytes(e)
    assert out["weights_bytes"]["catalog"] == e.weights_bytes and "weights_note" in out
    assert {"steady_ratio", "peak_ratio", "file_plan_steady_ratio", "file_plan_peak_ratio"} <= set(out)
    json.dumps(out)
