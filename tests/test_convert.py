"""convert_hf_to_mlc on tiny random checkpoints: bit-exact q4f16_1, MLC names and layout, errors."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from engine.convert import ALIGN, convert_hf_to_mlc, main
from engine.errors import ModelFormatError, UnsupportedModelError, ZeroTVMError
from engine.formats.mlc import MlcCheckpoint
from tests.helpers import DEFAULTS, cached_tiny_hf

pytestmark = pytest.mark.model


def ref_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The q4f16_1 spec written out group by group: scale = max|w|/7 as f16 (0 for an all-zero group),
    q = clamp(round(w / scale) + 7, 0, 14) against the stored scale, element j of a word at bits 4j."""
    n, k = w.shape
    scale = np.zeros((n, k // 32), np.float16)
    words = np.zeros((n, k // 8), np.uint32)
    for g in range(k // 32):
        block = w[:, 32 * g: 32 * (g + 1)].astype(np.float32)
        s = (np.abs(block).max(axis=1).astype(np.float64) / 7).astype(np.float16)
        scale[:, g] = s
        step = s.astype(np.float32)[:, None]
        q = np.full(block.shape, 7.0, np.float32)
        live = s > 0
        q[live] = np.clip(np.rint(block[live] / step[live]) + 7, 0, 14)
        for j in range(32):
            words[:, (32 * g + j) // 8] |= q[:, j].astype(np.uint32) << np.uint32(4 * (j % 8))
    return words, scale


def hf_tensors(hf_dir) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(f, framework="numpy") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def assert_quantized(ckpt: MlcCheckpoint, base: str, w: np.ndarray) -> None:
    want_w, want_s = ref_quantize(w)
    got_w = ckpt.tensor(f"{base}.q_weight", dtype=np.uint32, shape=want_w.shape)
    got_s = ckpt.tensor(f"{base}.q_scale", dtype=np.float16, shape=want_s.shape)
    np.testing.assert_array_equal(got_w, want_w, err_msg=base)
    assert np.array_equal(got_s.view(np.uint16), want_s.view(np.uint16)), base  # bit for bit, -0 included


def assert_norm(ckpt: MlcCheckpoint, name: str, w: np.ndarray) -> None:
    got = ckpt.tensor(name, dtype=np.float16, shape=w.shape)
    assert np.array_equal(got.view(np.uint16), w.astype(np.float16).view(np.uint16)), name


PHI3_LAYER = {  # MLC name -> HF name, as in mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC
    "mixer.qkv_proj": "self_attn.qkv_proj.weight",
    "mixer.out_proj": "self_attn.o_proj.weight",
    "mlp.gate_up_proj": "mlp.gate_up_proj.weight",
    "mlp.down_proj": "mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def phi3_hf():
    return cached_tiny_hf("phi3")


@pytest.fixture(scope="module")
def phi3_mlc(phi3_hf, tmp_path_factory):
    return convert_hf_to_mlc(phi3_hf, tmp_path_factory.mktemp("phi3") / "mlc")


def test_phi3_round_trip_is_bit_exact(phi3_hf, phi3_mlc):
    hf = hf_tensors(phi3_hf)
    ckpt = MlcCheckpoint(phi3_mlc)
    expected = {"transformer.embd.q_weight", "transformer.embd.q_scale", "transformer.norm.weight",
                "lm_head.q_weight", "lm_head.q_scale"}
    for i in range(2):
        expected |= {f"transformer.h.{i}.ln.weight", f"transformer.h.{i}.post_attention_layernorm.weight"}
        expected |= {f"transformer.h.{i}.{m}.{s}" for m in PHI3_LAYER for s in ("q_weight", "q_scale")}
    assert set(ckpt.names()) == expected

    assert_quantized(ckpt, "transformer.embd", hf["model.embed_tokens.weight"])
    assert_quantized(ckpt, "lm_head", hf["lm_head.weight"])
    assert_norm(ckpt, "transformer.norm.weight", hf["model.norm.weight"])
    for i in range(2):
        for mlc, src in PHI3_LAYER.items():
            assert_quantized(ckpt, f"transformer.h.{i}.{mlc}", hf[f"model.layers.{i}.{src}"])
        assert_norm(ckpt, f"transformer.h.{i}.ln.weight", hf[f"model.layers.{i}.input_layernorm.weight"])
        assert_norm(ckpt, f"transformer.h.{i}.post_attention_layernorm.weight",
                    hf[f"model.layers.{i}.post_attention_layernorm.weight"])


def test_phi3_config_and_tokenizer_files(phi3_hf, phi3_mlc):
    ckpt = MlcCheckpoint(phi3_mlc)
    hf_config = json.loads((phi3_hf / "config.json").read_text())
    assert ckpt.model_type == "phi3" and ckpt.config["quantization"] == "q4f16_1"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        assert ckpt.model_config[key] == hf_config[key]
    assert ckpt.config["context_window_size"] == ckpt.model_config["context_window_size"] == 512
    assert ckpt.config["vocab_size"] == DEFAULTS["phi3"]["vocab_size"]
    assert ckpt.config["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (phi3_mlc / name).read_bytes() == (phi3_hf / name).read_bytes()
    assert (ckpt.config["bos_token_id"], ckpt.config["eos_token_id"]) == (1, 2)
    # The runtime's phi3 spec finds every tensor it asks for.
    from engine.models import model_module

    module = model_module(ckpt.model_type)
    spec = module.spec(module.ModelArgs.from_dict(ckpt.model_config))
    assert set(spec.names.values()) <= set(ckpt.names())


def check_layout(root, cap):
    """Shard files match the manifest: sizes, md5, aligned non-overlapping records, shards within the cap."""
    manifest = json.loads((root / "ndarray-cache.json").read_text())
    assert set(manifest["metadata"]) == {"ParamSize", "ParamBytes", "BitsPerParam"}
    groups = manifest["records"]
    assert [g["dataPath"] for g in groups] == [f"params_shard_{i}.bin" for i in range(len(groups))]
    assert sorted(p.name for p in root.glob("params_shard_*.bin")) == sorted(g["dataPath"] for g in groups)
    for g in groups:
        data = (root / g["dataPath"]).read_bytes()
        assert g["format"] == "raw-shard" and g["nbytes"] == len(data)
        assert g["md5sum"] == hashlib.md5(data).hexdigest()
        assert len(data) <= cap or len(g["records"]) == 1
        end = 0
        for r in g["records"]:
            assert r["byteOffset"] % ALIGN == 0 and r["byteOffset"] >= end
            assert r["format"] == "f32-to-bf16" and r["dtype"] in ("uint32", "float16")
            end = r["byteOffset"] + r["nbytes"]
        assert end == len(data)
    return groups


def test_shards_split_at_the_cap_and_load_reports_each(phi3_hf, phi3_mlc, tmp_path):
    assert len(check_layout(phi3_mlc, 32 << 20)) == 1
    cap = 12 << 10
    seen = []
    out = convert_hf_to_mlc(phi3_hf, tmp_path / "mlc", shard_cap_bytes=cap, on_progress=lambda *a: seen.append(a))
    groups = check_layout(out, cap)
    assert len(groups) >= 4
    assert [s[:2] for s in seen] == [(i + 1, len(seen)) for i in range(len(seen))]
    small, big = MlcCheckpoint(out), MlcCheckpoint(phi3_mlc)
    calls = []
    loaded = dict(small.load(on_progress=lambda *a: calls.append(a)))
    assert [c[:3] for c in calls] == [(i, len(groups), str(out / g["dataPath"])) for i, g in enumerate(groups)]
    assert [c[3] for c in calls] == sorted(c[3] for c in calls) and calls[-1][3] == calls[-1][4]
    for name in big.names():
        np.testing.assert_array_equal(loaded[name], big.tensor(name))
    # Converting again with one shard removes the now-stale extra shards.
    convert_hf_to_mlc(phi3_hf, out)
    assert len(check_layout(out, 32 << 20)) == 1


def test_llama_fuses_qkv_and_gate_up(tmp_path):
    hf_dir = cached_tiny_hf("llama")
    hf = hf_tensors(hf_dir)
    ckpt = MlcCheckpoint(convert_hf_to_mlc(hf_dir, tmp_path / "mlc"))
    assert ckpt.model_type == "llama" and "lm_head.q_weight" in ckpt
    p = "model.layers.1"
    qkv = np.concatenate([hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert qkv.shape == (64 + 2 * 32, 64)  # 4 query heads, 2 KV heads of 16
    assert_quantized(ckpt, f"{p}.self_attn.qkv_proj", qkv)
    assert_quantized(ckpt, f"{p}.mlp.gate_up_proj",
                     np.concatenate([hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]]))
    assert_quantized(ckpt, f"{p}.mlp.down_proj", hf[f"{p}.mlp.down_proj.weight"])
    assert_quantized(ckpt, "model.embed_tokens", hf["model.embed_tokens.weight"])
    assert_norm(ckpt, "model.norm.weight", hf["model.norm.weight"])


def test_qwen3_tied_embedding_and_qk_norms(tmp_path):
    hf_dir = cached_tiny_hf("qwen3")
    hf = hf_tensors(hf_dir)
    ckpt = MlcCheckpoint(convert_hf_to_mlc(hf_dir, tmp_path / "mlc"))
    assert not any(n.startswith("lm_head") for n in ckpt.names())
    assert_quantized(ckpt, "model.layers.0.self_attn.c_attn",
                     np.concatenate([hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))
    for x in ("q_norm", "k_norm"):
        assert_norm(ckpt, f"model.layers.0.self_attn.{x}.weight", hf[f"model.layers.0.self_attn.{x}.weight"])


def test_sharded_bf16_input_and_zero_groups(phi3_hf, tmp_path):
    import torch

    hf = hf_tensors(phi3_hf)
    down = hf["model.layers.0.mlp.down_proj.weight"]
    down[:, 32:64] = 0  # an all-zero group in every row
    down[5] = 0  # and an all-zero row
    src = tmp_path / "hf"
    src.mkdir()
    shutil.copy(phi3_hf / "config.json", src)
    names = sorted(hf)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    from safetensors.torch import save_file as save_torch

    for file, part in halves.items():
        save_torch({n: torch.from_numpy(hf[n]).to(torch.bfloat16) for n in part}, src / file)
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "stray.safetensors").write_bytes(b"ignored: the index names the files")

    ckpt = MlcCheckpoint(convert_hf_to_mlc(src, tmp_path / "mlc"))
    as_bf16 = {n: torch.from_numpy(v).to(torch.bfloat16).float().numpy() for n, v in hf.items()}
    assert_quantized(ckpt, "transformer.h.0.mlp.down_proj", as_bf16["model.layers.0.mlp.down_proj.weight"])
    assert_quantized(ckpt, "transformer.embd", as_bf16["model.embed_tokens.weight"])
    assert_norm(ckpt, "transformer.h.1.ln.weight", as_bf16["model.layers.1.input_layernorm.weight"])
    q_weight = ckpt.tensor("transformer.h.0.mlp.down_proj.q_weight")
    q_scale = ckpt.tensor("transformer.h.0.mlp.down_proj.q_scale")
    assert (q_scale[:, 1] == 0).all() and (q_scale[5] == 0).all()
    assert (q_weight[:, 4:8] == 0x77777777).all() and (q_weight[5] == 0x77777777).all()  # q = 7 means 0


def test_cli(phi3_hf, tmp_path, capsys):
    assert main([str(phi3_hf), str(tmp_path / "out"), "--shard-mb", "1"]) == 0
    assert MlcCheckpoint(tmp_path / "out").model_type == "phi3"
    assert main([str(tmp_path / "nope"), str(tmp_path / "out2")]) == 1
    assert "nope: Hugging Face model folder not found" in capsys.readouterr().err


# -- bad input: each error names the file and the tensor or field at fault ----------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_folder_config_and_weights(phi3_hf, tmp_path):
    with pytest.raises(ModelFormatError, match=r"nowhere: Hugging Face model folder not found"):
        convert_hf_to_mlc(tmp_path / "nowhere", tmp_path / "out")
    src = _copy(phi3_hf, tmp_path / "hf")
    (src / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"config\.json: missing"):
        convert_hf_to_mlc(src, tmp_path / "out")
    src = _copy(phi3_hf, tmp_path / "hf2")
    for f in src.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelFormatError, match=r"hf2: no \*\.safetensors"):
        convert_hf_to_mlc(src, tmp_path / "out")
    with pytest.raises(ZeroTVMError, match=r"quantization 'q8f16_0' is not supported"):
        convert_hf_to_mlc(phi3_hf, tmp_path / "out", quantization="q8f16_0")


def test_bad_model_type(phi3_hf, tmp_path):
    src = _copy(phi3_hf, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: model_type 'gpt2' is not supported"):
        convert_hf_to_mlc(src, tmp_path / "out")
    del config["model_type"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"config\.json: no 'model_type' field"):
        convert_hf_to_mlc(src, tmp_path / "out")


def test_k_not_multiple_of_32(tmp_path):
    hf_dir = cached_tiny_hf("phi3", intermediate_size=100)
    with pytest.raises(ModelFormatError,
                       match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
                             r"\[64, 100\]; .*multiple of 32"):
        convert_hf_to_mlc(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # shapes are checked from the headers before writing


def test_missing_and_unmapped_tensors(phi3_hf, tmp_path):
    src = _copy(phi3_hf, tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    bias = tensors.pop("model.layers.1.mlp.down_proj.weight")[:, 0].copy()
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight' "
                                               r"\(needed for transformer\.h\.1\.mlp\.down_proj\) not found"):
        convert_hf_to_mlc(src, tmp_path / "out")
    tensors = load_file(phi3_hf / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = bias
    save_file(tensors, src / "model.safetensors")
    unmapped = r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.bias' has no MLC mapping"
    with pytest.raises(UnsupportedModelError, match=unmapped + r" for model_type 'phi3'"):
        convert_hf_to_mlc(src, tmp_path / "out")


def test_truncated_safetensors(phi3_hf, tmp_path):
    src = _copy(phi3_hf, tmp_path / "hf")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelFormatError, match=r"model\.safetensors: tensor '.*' needs bytes up to \d+ but the file "
                                               r"is \d+ bytes \(truncated download\?\)"):
        convert_hf_to_mlc(src, tmp_path / "out")
