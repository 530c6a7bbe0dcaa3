"""MLX reader: tiny Qwen3.5-MoE checkpoints made by mlx-lm itself (quantize_model + save_model + save_config),
read back with MlxCheckpoint. Every quantized tensor must dequantize to exactly what mx.dequantize gives (with
the scales in f32, as our kernels compute), stacked experts included; the 8-bit router and the widened 3-bit
experts also run through the existing matvec/GEMM kernels. Checkpoints are built once into .cache/.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.mlx import MlxCheckpoint, dequantize, widen_codes
from engine.kernels.matmul import format_knobs, gemm_plan, matvec_plan
from engine.packed import PackedWeight
from tests.helpers import moe_block, poisoned, read, record_moe_block, run, step_uniform

pytestmark = pytest.mark.model

mx = pytest.importorskip("mlx.core", reason="the MLX reader tests build checkpoints with mlx (pip install mlx[cpu])")
pytest.importorskip("mlx_lm", reason="the MLX reader tests build checkpoints with mlx-lm")

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "test-mlx"
TEXT = dict(model_type="qwen3_5_moe_text", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6, vocab_size=256,
            linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=8, num_experts_per_tok=2,
            shared_expert_intermediate_size=64, moe_intermediate_size=64, norm_topk_prob=True,
            tie_word_embeddings=False)
ROUTER = "language_model.model.layers.0.mlp.gate"
EXPERT_UP = "language_model.model.layers.0.mlp.switch_mlp.up_proj"


def build(path: Path, variant: str) -> None:
    """q4: everything 4-bit with mlx-lm's own predicate (router and shared-expert gate 8-bit), like
    lmstudio-community's 4-bit build; q3exp: routed experts 3-bit, the rest as q4 (zero-tvm's q3 build)."""
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.utils import quantize_model, save_config, save_model

    mx.random.seed(0)
    config = {"model_type": "qwen3_5_moe", "text_config": dict(TEXT)}
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)  # real checkpoints are bf16: scales, biases and norms too
    base = model.quant_predicate

    def predicate(path, module):
        if variant == "q3exp" and ".switch_mlp." in path:
            return {"group_size": 64, "bits": 3}
        return base(path, module)

    model, config = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    save_model(path, model)
    save_config(config, path / "config.json")


def cached(variant: str) -> Path:
    """The variant's checkpoint, built once per mlx version (built aside, then renamed into place)."""
    path = CACHE / f"{variant}-mlx{mx.__version__}-v1"
    if not (path / "config.json").is_file():
        tmp = CACHE / f".{path.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp, variant)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


@pytest.fixture(scope="session", params=["q4", "q3exp"])
def checkpoint(request) -> Path:
    return cached(request.param)


@pytest.fixture(scope="session")
def q4() -> Path:
    return cached("q4")


def mlx_tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= mx.load(str(f))
    return out


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def rewrite(path: Path, change) -> None:
    """Rewrite the checkpoint's single shard and index through `change(tensors) -> tensors`."""
    tensors = change(mx.load(str(path / "model.safetensors")))
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def edit_config(path: Path, change) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ---- reading -------------------------------------------------------------------------------------------
def test_config_and_formats(checkpoint):
    ckpt = MlxCheckpoint(checkpoint)
    assert ckpt.config["hidden_size"] == 128 and ckpt.config["num_experts"] == 8  # from text_config
    names = ckpt.tensor_names()
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in names
    assert not any(n.endswith((".scales", ".biases")) or n.startswith("language_model.") for n in names)
    formats = ckpt.formats()
    assert formats["model.layers.0.mlp.gate.weight"] == "mlx8"  # the 8-bit router override
    assert formats["model.layers.1.mlp.shared_expert_gate.weight"] == "mlx8"
    # 3-bit expert stacks stay 3-bit (the decode matvecs read them as stored)
    assert formats["model.layers.0.mlp.switch_mlp.down_proj.weight"] == ("mlx3" if "q3exp" in checkpoint.name
                                                                        else "mlx4")
    assert formats["model.layers.0.input_layernorm.weight"] == "f16"
    assert formats["model.layers.0.linear_attn.A_log"] == formats["model.layers.0.linear_attn.dt_bias"] == "f32"
    assert ckpt.shape("model.layers.0.mlp.switch_mlp.down_proj.weight") == (8, 128, 64)


def test_every_quantized_tensor_equals_mx_dequantize(checkpoint):
    ckpt, raw = MlxCheckpoint(checkpoint), mlx_tensors(checkpoint)
    seen_bits = set()
    for name, weight in ckpt.load():
        if "q_weight" not in weight:
            continue
        key = "language_model." + name[: -len(".weight")]
        w, s, b = raw[key + ".weight"], raw[key + ".scales"], raw[key + ".biases"]
        bits = weight.bits
        seen_bits.add(bits)
        ref = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), 64, bits))
        np.testing.assert_array_equal(dequantize(weight), ref, err_msg=name)
        # Layout: E (for stacked experts) leading, K·bits/32 words per row, (scale, bias) pairs exactly.
        k, stored = ref.shape[-1], {"mlx3": 3, "mlx4": 4, "mlx8": 8}[weight.format]
        assert weight["q_weight"].shape == (*ref.shape[:-1], k * stored // 32)
        assert weight["q_scale"].shape == (*ref.shape[:-1], k // 64, 2) and weight["q_scale"].dtype == np.float16
        np.testing.assert_array_equal(weight["q_scale"][..., 0].astype(np.float32), np.array(s.astype(mx.float32)))
        np.testing.assert_array_equal(weight["q_scale"][..., 1].astype(np.float32), np.array(b.astype(mx.float32)))
        if bits == 4 or bits == 8:  # MLX's own word order is ours: copied as is
            np.testing.assert_array_equal(weight["q_weight"], np.array(w))
    assert seen_bits == ({3, 4, 8} if "q3exp" in checkpoint.name else {4, 8})


def test_unquantized_tensors(checkpoint):
    ckpt, raw = MlxCheckpoint(checkpoint), mlx_tensors(checkpoint)
    for name, dtype in [("model.norm.weight", np.float16), ("model.layers.1.self_attn.q_norm.weight", np.float16),
                        ("model.layers.0.linear_attn.conv1d.weight", np.float16),
                        ("model.layers.0.linear_attn.A_log", np.float32),
                        ("model.layers.0.linear_attn.dt_bias", np.float32)]:
        weight = ckpt.read(name)
        ref = np.array(raw["language_model." + name].astype(mx.float32))
        assert weight["weight"].dtype == dtype and weight.format == np.dtype(dtype).name.replace("float", "f")
        np.testing.assert_array_equal(weight["weight"].astype(np.float32), ref)  # bf16 -> f16 exact in range
    assert ckpt.read("model.layers.0.linear_attn.conv1d.weight")["weight"].shape == (256, 4, 1)


def test_moe_weights_stack_experts(checkpoint):
    w = MlxCheckpoint(checkpoint).moe_weights(1)
    assert set(w) == {"gate", "shared_expert_gate", "switch_mlp.gate_proj", "switch_mlp.up_proj",
                      "switch_mlp.down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                      "shared_expert.down_proj"}
    words = 12 if "q3exp" in checkpoint.name else 16  # [E, N, K·bits/32]: 3-bit rows stay 3-bit
    assert w["switch_mlp.up_proj"]["q_weight"].shape == (8, 64, words)
    assert w["switch_mlp.down_proj"]["q_scale"].shape == (8, 128, 1, 2)
    assert w["gate"].format == "mlx8" and w["gate"]["q_weight"].shape == (8, 32)


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_widen_codes_matches_mx_dequantize(rng, bits):
    w = mx.array(rng.standard_normal((5, 192)).astype(np.float32))
    q = np.array(mx.quantize(w, 64, bits)[0])
    wide = widen_codes(q, bits)
    per = 8 if bits <= 4 else 4
    shifts = np.arange(per, dtype=np.uint32) * (32 // per)
    codes = ((wide[..., None] >> shifts) & np.uint32(2 ** (32 // per) - 1)).reshape(5, 192)
    # The spec, independently: one LSB-first bitstream per row, code i at bits [bits·i, bits·i + bits).
    stream = np.unpackbits(q.view(np.uint8), axis=1, bitorder="little").reshape(5, 192, bits)
    np.testing.assert_array_equal(codes, (stream << np.arange(bits)).sum(-1))
    assert codes.max() == 2**bits - 1 and codes.min() == 0


def test_sharded_index_and_vision_tower(q4, tmp_path):
    # Two language shards plus a vision shard that is not even a safetensors file: it must never be opened.
    path = copy(q4, tmp_path)
    tensors = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(tensors)
    shards = {"model-00001-of-00003.safetensors": keys[::2], "model-00002-of-00003.safetensors": keys[1::2]}
    for file, part in shards.items():
        mx.save_safetensors(str(path / file), {k: tensors[k] for k in part}, metadata={"format": "mlx"})
    (path / "model-00003-of-00003.safetensors").write_bytes(b"not safetensors")
    weight_map = {k: f for f, part in shards.items() for k in part}
    weight_map["vision_tower.blocks.0.attn.qkv.weight"] = "model-00003-of-00003.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ckpt, single = MlxCheckpoint(path), MlxCheckpoint(q4)
    assert set(ckpt.tensor_names()) == set(single.tensor_names())
    for name in ("model.layers.0.mlp.switch_mlp.gate_proj.weight", "model.norm.weight"):
        a, b = ckpt.read(name), single.read(name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_single_file_without_index(q4, tmp_path):
    path = copy(q4, tmp_path)
    (path / "model.safetensors.index.json").unlink()
    w = MlxCheckpoint(path).read("model.layers.0.mlp.gate.weight")
    assert w.format == "mlx8" and w.sources[0] == ROUTER + ".weight"


# ---- bad input -----------------------------------------------------------------------------------------
def test_missing_expert_tensor(q4, tmp_path):
    path = copy(q4, tmp_path)
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != EXPERT_UP + ".weight"})
    ckpt = MlxCheckpoint(path)
    with pytest.raises(ModelFormatError, match=r"model.safetensors.index.json: no tensor "
                       r"'language_model.model.layers.0.mlp.switch_mlp.up_proj.weight'"):
        ckpt.moe_weights(0)
    ckpt.moe_weights(1)  # the other layer is whole


def test_missing_biases(q4, tmp_path):
    path = copy(q4, tmp_path)
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != EXPERT_UP + ".biases"})
    with pytest.raises(ModelFormatError, match=f"no tensor '{EXPERT_UP}.biases'"):
        MlxCheckpoint(path).read("model.layers.0.mlp.switch_mlp.up_proj.weight")


def test_expert_count_differs_from_config(q4, tmp_path):
    path = copy(q4, tmp_path)
    edit_config(path, lambda c: c["text_config"].update(num_experts=7))
    with pytest.raises(ModelFormatError, match=r"model.safetensors: tensor '.*mlp.gate.weight' holds a \[8, 128\] "
                       r"matrix; config.json implies \[7, 128\]"):
        MlxCheckpoint(path).moe_weights(0)


@pytest.mark.parametrize("module,bits", [("", 3), (ROUTER, 4)])
def test_wrong_bit_width(q4, tmp_path, module, bits):
    # The default says 3-bit (every 4-bit tensor then has too many words), or the router override says 4.
    path = copy(q4, tmp_path)
    edit_config(path, lambda c: (c["quantization"][module] if module else c["quantization"]).update(bits=bits))
    name = "model.layers.0.mlp.gate.weight" if module else "model.layers.0.mlp.switch_mlp.up_proj.weight"
    key = "language_model." + name
    with pytest.raises(ModelFormatError, match=rf"model.safetensors: tensor '{key}' has \d+ u32 words per row.*"
                       rf"at {bits} bits need"):
        MlxCheckpoint(path).read(name)


def test_truncated_shard(q4, tmp_path):
    path = copy(q4, tmp_path)
    shard = path / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ModelFormatError, match=r"model.safetensors: tensor '.*' needs bytes up to \d+ but the file "
                       r"is \d+ bytes \(truncated download\?\)"):
        MlxCheckpoint(path)
    shard.write_bytes(data[:5])
    with pytest.raises(ModelFormatError, match="not a safetensors file, or truncated"):
        MlxCheckpoint(path)


def test_missing_shard_and_config(q4, tmp_path):
    path = copy(q4, tmp_path)
    (path / "model.safetensors").rename(path / "elsewhere.safetensors")
    with pytest.raises(ModelFormatError, match="is in shard 'model.safetensors', which is missing"):
        MlxCheckpoint(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="config.json: missing"):
        MlxCheckpoint(path)


def test_scale_past_f16_range(q4, tmp_path):
    path = copy(q4, tmp_path)

    def huge(t):
        s = t[ROUTER + ".scales"].astype(mx.float32)
        t[ROUTER + ".scales"] = mx.where(mx.arange(s.size).reshape(s.shape) == 3, 1e6, s)
        return t

    rewrite(path, huge)
    with pytest.raises(ModelFormatError, match=rf"tensor '{ROUTER}.scales' holds 1e\+06, past f16's range"):
        MlxCheckpoint(path).read("model.layers.0.mlp.gate.weight")


def test_unsupported_quantization(q4, tmp_path):
    path = copy(q4, tmp_path)
    edit_config(path, lambda c: c["quantization"].update(mode="mxfp4"))
    with pytest.raises(UnsupportedModelError, match="MLX mode 'mxfp4'"):
        MlxCheckpoint(path).read("lm_head.weight")
    edit_config(path, lambda c: c["quantization"].update(mode="affine", group_size=32))
    with pytest.raises(UnsupportedModelError, match="group size 32"):
        MlxCheckpoint(path).read("lm_head.weight")


# ---- through the kernels ----------------------------------------------------------------------------------
def test_existing_kernels_run_mlx8_and_mlx4(any_gpu, checkpoint, rng):
    # matvec_int4 / matmul_int4 take BITS=8 with AFFINE and GROUP=64 (the router) and mlx4 experts; 3-bit expert
    # rows run in the matvec only (the GEMM refuses them): run them on the tensors read from the checkpoint.
    g, ckpt = any_gpu, MlxCheckpoint(checkpoint)
    router = ckpt.read("model.layers.0.mlp.gate.weight")
    stack = ckpt.read("model.layers.0.mlp.switch_mlp.gate_proj.weight")
    expert = PackedWeight({k: a[3] for k, a in stack.items()}, stack.format, stack.shape[1:], ())  # expert 3
    for weight in (router, expert):
        (n, k), fmt = weight.shape, format_knobs(weight.format)
        ref_w = dequantize(weight).astype(np.float64)
        x = rng.standard_normal((3, k)).astype(np.float32)
        buffers = [g.upload("x", x), g.upload("w", weight["q_weight"]), g.upload("s", weight["q_scale"])]
        consts, grid = matvec_plan(k, n, **fmt)
        y = poisoned(g, "y", (n,))
        run(g, "matvec_int4", consts, buffers + [y, step_uniform(g, 3)], grid)
        np.testing.assert_allclose(read(g, y, (n,)), x[0] @ ref_w.T, rtol=1e-4, atol=1e-5)
        if weight.format == "mlx3":
            with pytest.raises(ValueError, match="decode matvecs"):
                gemm_plan(k, n, 3, **fmt)
            continue
        consts, grid = gemm_plan(k, n, 3, **fmt)
        y = poisoned(g, "y", (3, n))
        run(g, "matmul_int4", consts, buffers + [y, step_uniform(g, 3)], grid)
        np.testing.assert_allclose(read(g, y, (3, n)), x @ ref_w.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T", [1, 3])
def test_moe_block_from_checkpoint_matches_mlx_lm(gpu, checkpoint, rng, T):
    # The layer as mlx-lm's own SparseMoeBlock computes it (f32, on mx.dequantize's values) vs the runtime's MoE
    # block fed by MlxCheckpoint.moe_weights.
    from mlx_lm.models.qwen3_5 import SparseMoeBlock, TextModelArgs

    ckpt, raw = MlxCheckpoint(checkpoint), mlx_tensors(checkpoint)
    cfg = ckpt.config
    ref = SparseMoeBlock(TextModelArgs(**{k: v for k, v in TEXT.items() if k != "model_type"}))
    prefix = "language_model.model.layers.0.mlp."
    params = {}
    for name in ckpt.moe_weights(0):
        key = prefix + name
        bits = 8 if name.endswith("gate") else (3 if "q3exp" in checkpoint.name and "switch" in name else 4)
        params[name + ".weight"] = mx.dequantize(raw[key + ".weight"], raw[key + ".scales"].astype(mx.float32),
                                                 raw[key + ".biases"].astype(mx.float32), 64, bits)
    ref.load_weights(list(params.items()))
    x = rng.standard_normal((T, cfg["hidden_size"])).astype(np.float32)
    expect = np.array(ref(mx.array(x)[None]))[0]

    block, ws = moe_block(gpu, [ckpt.moe_weights(0)], cfg["num_experts_per_tok"], cfg["norm_topk_prob"], 4)
    q3 = "q3exp" in checkpoint.name  # 3-bit routed experts and a 4-bit shared one: not one stack
    assert block.stacked[0] != q3 and block.dispatches_per_token() == (7 if q3 else 5)
    got, _ = record_moe_block(gpu, block, ws, x)
    err = np.abs(got - expect).max() / np.abs(expect).max()
    assert err < 2e-4, err
