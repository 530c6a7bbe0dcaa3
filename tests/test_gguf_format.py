"""GGUF reader: tiny files written with gguf.GGUFWriter from random weights, read back with GgufCheckpoint.

Quantized blocks come from the gguf package's own quantizers, and llama's q/k rows are permuted the way
llama.cpp's convert_hf_to_gguf.py does, so the files look like the converter's output. Nothing is
downloaded.
"""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats import kquant
from engine.formats.gguf import GgufCheckpoint, dequantize, pack_rows, unpermute_index
from engine.kernels.matmul import format_knobs, matvec_plan
from engine.packed import PackedWeight
from tests.helpers import (
    DIMS,
    Q,
    gguf_tensors,
    hf_weights,
    kquant_raw,
    llama_cpp_permute,
    make_model,
    poisoned,
    read,
    roundtrip,
    run,
    step_uniform,
    write_gguf,
)


def hf_canonical(w, name, layers):
    """The HF matrix/vector behind a canonical name (qkv and gate_up fused by rows)."""
    c = name.rsplit(".", 1)
    if c[-1] == "qkv":
        return np.concatenate([w[f"{c[0]}.{p}"] for p in "qkv"])
    if c[-1] == "gate_up":
        return np.concatenate([w[f"{c[0]}.gate"], w[f"{c[0]}.up"]])
    return w[name]


# ---- layout by hand ----------------------------------------------------------------------------------
def test_q4_0_block_repacks_to_our_nibble_order():
    # One block: d = 1.0, byte j holds element j (low nibble) and element j+16 (high nibble).
    elements = np.arange(32) % 16  # element i has code i % 16
    qs = (elements[:16] | (elements[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([1.0], np.float16).view(np.uint8), qs])[None]
    packed = pack_rows(Q.Q4_0, block)
    # Ours: element i at bits 4·(i % 8) of word i / 8 -> words 0x76543210, 0xFEDCBA98, then again.
    assert packed["q_weight"].tolist() == [[0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]]
    assert packed["q_scale"].tolist() == [[1.0]]
    weight = PackedWeight(packed, "q4_0", (1, 32), ())
    np.testing.assert_array_equal(dequantize(weight), gguf_dequantize(block, Q.Q4_0))


def test_q4_1_and_q8_0_blocks_by_hand():
    dm = np.array([0.5, -2.0], np.float16).view(np.uint8)
    q41 = np.concatenate([dm, np.full(16, 0x3A, np.uint8)])[None]  # elements 0..15 = 10, 16..31 = 3
    packed = pack_rows(Q.Q4_1, q41)
    assert packed["q_weight"][0, 0] == 0xAAAAAAAA and packed["q_weight"][0, 2] == 0x33333333
    assert packed["q_scale"].shape == (1, 1, 2) and packed["q_scale"].tolist() == [[[0.5, -2.0]]]
    codes = np.arange(-128, 128, 8, dtype=np.int8)  # 32 int8 values
    q80 = np.concatenate([np.array([0.25], np.float16).view(np.uint8), codes.view(np.uint8)])[None]
    packed8 = pack_rows(Q.Q8_0, q80)
    # Byte k % 4 of word k / 4 holds code + 128: element 0 = -128 -> 0, element 1 = -120 -> 8, ...
    assert packed8["q_weight"].shape == (1, 8) and packed8["q_weight"][0, 0] == 0x18100800
    for fmt, blocks, qtype in (("q4_1", q41, Q.Q4_1), ("q8_0", q80, Q.Q8_0)):
        weight = PackedWeight(pack_rows(qtype, blocks), fmt, (1, 32), ())
        np.testing.assert_array_equal(dequantize(weight), gguf_dequantize(blocks, qtype))


def test_unpermute_inverts_llama_cpp_permute(rng):
    w = rng.standard_normal((6 * 16, 8))
    for heads in (6, 2):  # q (n_head) and k (n_head_kv)
        stored = llama_cpp_permute(w, heads)
        back = np.empty_like(stored)
        back[unpermute_index(len(w), heads)] = stored
        np.testing.assert_array_equal(back, w)


# ---- whole files -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3"])
def test_config_mapping(tmp_path, rng, arch):
    path, w, _ = make_model(tmp_path, rng, arch)
    ckpt = GgufCheckpoint(path)
    assert ckpt.architecture == arch
    cfg = ckpt.config
    assert cfg == {
        "model_type": arch,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 80, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 512, "tie_word_embeddings": arch == "qwen3",
        "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
    }
    names = ckpt.canonical_names()
    assert names[0] == "embed" and "norm" in names and ("lm_head" in names) == (arch != "qwen3")
    assert len(names) == 2 + (arch != "qwen3") + 2 * (6 + 2 * (arch == "qwen3"))
    assert ("layers.1.q_norm" in names) == (arch == "qwen3")
    assert ckpt.formats()["layers.0.qkv"] == "q4_0" and ckpt.formats()["norm"] == "f32"


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16], ids=lambda q: q.name)
def test_weights_round_trip(tmp_path, rng, arch, qtype):
    path, w, stored = make_model(tmp_path, rng, arch, qtype=qtype)
    ckpt = GgufCheckpoint(path)
    tag = {Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q8_0: "q8_0", Q.F16: "f16"}[qtype]
    seen = []
    for name, weight in ckpt.load():
        seen.append(name)
        ours = dequantize(weight)
        # HF order back: exactly what ggml's own quantize → dequantize gives for the HF rows.
        np.testing.assert_array_equal(ours, roundtrip(hf_canonical(w, name, DIMS["layers"]), qtype), err_msg=name)
        assert weight.format == (tag if ours.ndim == 2 else "f32")
        assert weight.shape == ours.shape
    assert seen == ckpt.canonical_names()

    # And against the stored blocks: re-applying llama.cpp's permutation gives ggml's dequantization.
    qkv = dequantize(dict(ckpt.load(["layers.1.qkv"]))["layers.1.qkv"])
    h, kv, hd = DIMS["heads"], DIMS["kv_heads"], DIMS["head_dim"]
    q, k, v = np.split(qkv, [h * hd, (h + kv) * hd])
    if arch == "llama":
        q, k = llama_cpp_permute(q, h, h), llama_cpp_permute(k, h, kv)
    if arch == "phi3":
        np.testing.assert_array_equal(qkv, gguf_dequantize(stored["blk.1.attn_qkv.weight"], qtype))
    else:
        for got, part in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
            np.testing.assert_array_equal(got, gguf_dequantize(stored[f"blk.1.{part}.weight"], qtype))


def test_packed_arrays_have_the_documented_layouts(tmp_path, rng):
    types = {"blk.0.attn_output.weight": Q.Q4_1, "blk.0.ffn_down.weight": Q.Q8_0, "output.weight": Q.F16}
    path, _, _ = make_model(tmp_path, rng, "llama", types=types)
    got = dict(GgufCheckpoint(path).load(["layers.0.qkv", "layers.0.o", "layers.0.down", "lm_head", "norm"]))
    qkv, o, down, head, norm = (got[n] for n in ("layers.0.qkv", "layers.0.o", "layers.0.down", "lm_head", "norm"))
    assert (qkv.format, qkv["q_weight"].shape, qkv["q_weight"].dtype) == ("q4_0", (128, 8), np.uint32)
    assert (qkv["q_scale"].shape, qkv["q_scale"].dtype) == ((128, 2), np.float16)
    assert qkv.sources == ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")
    assert (o.format, o["q_weight"].shape, o["q_scale"].shape) == ("q4_1", (64, 8), (64, 2, 2))
    assert (down.format, down["q_weight"].shape, down["q_scale"].shape) == ("q8_0", (64, 24), (64, 3))
    assert (head.format, head["weight"].dtype, head["weight"].shape) == ("f16", np.float16, (80, 64))
    assert (norm.format, norm["weight"].dtype, norm.shape) == ("f32", np.float32, (64,))
    for weight in (qkv, o, down):
        assert all(a.flags.c_contiguous for a in weight.values())


@pytest.mark.parametrize("tag,qtype", [("q4_0", Q.Q4_0), ("q4_1", Q.Q4_1), ("q8_0", Q.Q8_0), ("f16", Q.F16)])
def test_loaded_weights_run_in_the_matvec_kernel(gpu, tmp_path, rng, tag, qtype):
    # The format tag's kernel constants read the loader's arrays as dequantize() does.
    path, _, _ = make_model(tmp_path, rng, "llama", qtype=qtype)
    weight = dict(GgufCheckpoint(path).load(["layers.0.gate_up"]))["layers.0.gate_up"]
    N, K = weight.shape
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, **format_knobs(weight.format))
    w = weight.get("q_weight", weight.get("weight"))
    s = weight.get("q_scale", np.zeros(4, np.float16))  # f16 weights: bound, never read
    y = poisoned(gpu, "y", (N,))
    run(gpu, "matvec_int4", consts, [gpu.upload("x", x), gpu.upload("w", w), gpu.upload("s", s), y,
                                     step_uniform(gpu, 1)], grid)
    ref = dequantize(weight).astype(np.float64) @ x[0]
    out = read(gpu, y, (N,))
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


def test_progress_and_subset(tmp_path, rng):
    path, _, stored = make_model(tmp_path, rng, "phi3")
    calls = []
    names = ["layers.1.down", "embed", "layers.0.gate_up"]
    got = [n for n, _ in GgufCheckpoint(path).load(names, on_progress=lambda *a: calls.append(a))]
    assert got == names
    sizes = [stored[n].nbytes for n in ("blk.1.ffn_down.weight", "token_embd.weight", "blk.0.ffn_up.weight")]
    assert [c[0] for c in calls] == [0, 1, 2] and all(c[1] == 3 and c[2] == str(path) for c in calls)
    assert [c[3] for c in calls] == list(np.cumsum(sizes)) and calls[-1][4] == sum(sizes)


def test_metadata_decodes_plain_values(tmp_path, rng):
    extra = {"general.name": "tiny", "tokenizer.ggml.tokens": ["<s>", "é", "x"], "x.nested": [[1, 2], [3]],
             "x.ints": [5, 6, 7]}
    path, _, _ = make_model(tmp_path, rng, "qwen3", extra=extra)
    meta = GgufCheckpoint(path).metadata
    assert meta["general.architecture"] == "qwen3" and meta["general.name"] == "tiny"
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "é", "x"]
    assert meta["x.nested"] == [[1, 2], [3]] and meta["x.ints"] == [5, 6, 7]
    assert meta["qwen3.block_count"] == 2 and meta["qwen3.attention.layer_norm_rms_epsilon"] == 1e-5
    assert not any(k.startswith("GGUF.") for k in meta)


def test_rope_scaling_from_metadata_and_factor_tensors(tmp_path, rng):
    factors = np.linspace(1, 8, 8).astype(np.float32)  # head_dim/2 llama3-style divisors
    w = hf_weights(rng, "llama", **DIMS)
    tensors = dict(gguf_tensors("llama", w, **DIMS), **{"rope_freqs.weight": factors})
    write_gguf(tmp_path / "l3.gguf", "llama", tensors)
    assert GgufCheckpoint(tmp_path / "l3.gguf").config["rope_scaling"] == {
        "rope_type": "gguf_freq_factors", "factors": factors.tolist()}

    extra = {"phi3.rope.scaling.original_context_length": 256, "phi3.attention.sliding_window": 255}
    w = hf_weights(rng, "phi3", **DIMS)
    long, short = np.full(8, 2.0, np.float32), np.ones(8, np.float32)
    tensors = dict(gguf_tensors("phi3", w, **DIMS), **{"rope_factors_long.weight": long,
                                                       "rope_factors_short.weight": short})
    write_gguf(tmp_path / "p.gguf", "phi3", tensors, extra=extra)
    cfg = GgufCheckpoint(tmp_path / "p.gguf").config
    assert cfg["original_max_position_embeddings"] == 256 and cfg["sliding_window"] == 255
    assert cfg["rope_scaling"] == {"rope_type": "longrope", "long_factor": long.tolist(),
                                   "short_factor": short.tolist(), "original_max_position_embeddings": 256,
                                   "attention_factor": 1.0}  # no rope.scaling.attn_factor: llama.cpp applies 1


def test_bf16_norms_widen_exactly(tmp_path, rng):
    w = hf_weights(rng, "qwen3", **DIMS)
    path = tmp_path / "bf.gguf"
    stored = write_gguf(path, "qwen3", gguf_tensors("qwen3", w, **DIMS), types={"output_norm.weight": Q.BF16})
    norm = dict(GgufCheckpoint(path).load(["norm"]))["norm"]
    assert norm.format == "f32" and norm["weight"].dtype == np.float32
    np.testing.assert_array_equal(norm["weight"], gguf_dequantize(stored["output_norm.weight"], Q.BF16))


# ---- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [Q.IQ4_NL, Q.IQ2_XS, Q.TQ1_0], ids=lambda q: q.name)
def test_unsupported_quant_type_names_tensor_and_supported_types(tmp_path, rng, qtype):
    dims = dict(DIMS, dim=256, ffn=256, head_dim=64)  # whole blocks of every type (up to 256 elements)
    tensors = gguf_tensors("llama", hf_weights(rng, "llama", **dims), **dims)
    block, size = GGML_QUANT_SIZES[qtype]
    tensors["output.weight"] = (rng.integers(0, 256, (80, 256 // block * size), dtype=np.uint8), qtype)
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", tensors, qtype=Q.F16, dims=dims)
    ckpt = GgufCheckpoint(path)
    with pytest.raises(UnsupportedModelError, match=rf"'output\.weight' is {qtype.name}, which we cannot run .*"
                                                    r"supported types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, .*Q4_K_M") as e:
        list(ckpt.load(["embed", "lm_head"]))
    assert str(path) in str(e.value)
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        ckpt.formats()
    assert len(dict(ckpt.load(["embed"]))["embed"]["weight"]) == 80  # other weights still load


def test_missing_tensor_is_named(tmp_path, rng):
    path, _, _ = make_model(tmp_path, rng, "qwen3", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelFormatError, match=r"qwen3\.gguf: no tensor 'blk\.1\.ffn_down\.weight'.*similar"):
        list(GgufCheckpoint(path).load())


def test_fused_gate_up_parts_must_share_a_type(tmp_path, rng):
    path, _, _ = make_model(tmp_path, rng, "llama", types={"blk.0.ffn_up.weight": Q.Q8_0})
    with pytest.raises(ModelFormatError, match=r"layers\.0\.gate_up fuses .*'blk\.0\.ffn_up\.weight' \(Q8_0\)"):
        list(GgufCheckpoint(path).load(["layers.0.gate_up"]))


def test_qkv_of_mixed_types_keeps_each_part(tmp_path, rng):
    # A Q4_K_M file's fallback layer: q and k in Q5_0, v in Q8_0 (rows of 64 are not a multiple of 256).
    types = {"blk.0.attn_v.weight": Q.Q8_0}
    path, w, stored = make_model(tmp_path, rng, "llama", qtype=Q.Q5_0, types=types)
    ckpt = GgufCheckpoint(path)
    assert ckpt.formats()["layers.0.qkv"] == "q5_0,q5_0,q8_0" and ckpt.formats()["layers.1.qkv"] == "q5_0"
    qkv = dict(ckpt.load(["layers.0.qkv"]))["layers.0.qkv"]
    assert sorted(qkv) == ["0.q_blocks", "0.q_d", "1.q_blocks", "1.q_d", "2.q_scale", "2.q_weight"]
    assert qkv.shape == (128, 64) and qkv.sources == tuple(f"blk.0.attn_{x}.weight" for x in "qkv")
    # HF row order back (llama's q/k permutation undone), each part as ggml dequantizes it
    ref = np.concatenate([roundtrip(w[f"layers.0.{x}"], Q.Q8_0 if x == "v" else Q.Q5_0) for x in "qkv"])
    np.testing.assert_array_equal(dequantize(qkv), ref)


KQ_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1]


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3"])
@pytest.mark.parametrize("qtype", KQ_TYPES, ids=lambda q: q.name)
def test_kquant_weights_round_trip(tmp_path, rng, arch, qtype):
    # Blocks as stored: random bytes with finite scales (gguf quantizes no K type); every weight dequantizes as
    # ggml does, llama's q/k rows back in transformers' order.
    dims = dict(DIMS, dim=256, ffn=256, head_dim=64)
    tensors = {}
    for name, arr in gguf_tensors(arch, hf_weights(rng, arch, **dims), **dims).items():
        tensors[name] = (kquant_raw(rng, qtype, *arr.shape), qtype) if arr.ndim == 2 else arr
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, tensors, dims=dims)
    ckpt = GgufCheckpoint(path)
    tag = kquant.TAGS[qtype]
    assert {f for n, f in ckpt.formats().items() if not n.endswith("norm")} == {tag}
    table = {w.name: w for w in ckpt.table}
    for name, weight in ckpt.load():
        if weight.format != tag:
            continue
        parts = []
        for alt in table[name].gguf:
            if all(p.name in tensors for p in alt):
                for p in alt:
                    rows = gguf_dequantize(tensors[p.name][0], qtype)
                    if p.heads:  # stored row r is transformers' row unpermute_index[r]
                        back = np.empty_like(rows)
                        back[unpermute_index(len(rows), p.heads)] = rows
                        rows = back
                    parts.append(rows)
                break
        np.testing.assert_array_equal(dequantize(weight), np.concatenate(parts), err_msg=name)
        assert sum(a.nbytes for a in weight.values()) == sum(tensors[s][0].nbytes for s in weight.sources)


def test_damaged_kquant_scale_is_named(tmp_path, rng):
    dims = dict(DIMS, dim=256, ffn=256, head_dim=64)
    tensors = gguf_tensors("qwen3", hf_weights(rng, "qwen3", **dims), **dims)
    raw = kquant_raw(rng, Q.Q4_K, 256, 256)
    raw[3, 2:4] = np.array([np.nan], "<f2").view(np.uint8)  # row 3's first block: dmin NaN
    tensors["blk.1.ffn_down.weight"] = (raw, Q.Q4_K)
    path = tmp_path / "nan.gguf"
    write_gguf(path, "qwen3", tensors, qtype=Q.Q8_0, dims=dims)
    with pytest.raises(ModelFormatError, match=r"nan\.gguf: tensor 'blk\.1\.ffn_down\.weight': row 3 has a "
                                               r"non-finite block scale"):
        list(GgufCheckpoint(path).load(["layers.1.down"]))


@pytest.mark.parametrize("extra,match", [
    ({}, r"field 'llama\.block_count' is missing"),
    ({"llama.block_count": "two"}, r"field 'llama\.block_count' is 'two', expected a whole number from 1 to 1,024"),
])
def test_bad_metadata_is_named(tmp_path, rng, extra, match):
    w = hf_weights(rng, "llama", **DIMS)
    path = tmp_path / "m.gguf"
    # Everything but block_count, which `extra` may add with a bad value.
    writer_meta = {"llama.context_length": 512, "llama.embedding_length": 64, "llama.feed_forward_length": 96,
                   "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2}
    write_gguf(path, "llama", gguf_tensors("llama", w, **DIMS), meta=False, extra={**writer_meta, **extra})
    with pytest.raises(ModelFormatError, match=match):
        _ = GgufCheckpoint(path).config


def test_shape_disagreeing_with_metadata_is_named(tmp_path, rng):
    path, _, _ = make_model(tmp_path, rng, "llama", dims=dict(DIMS, ffn=128))  # tensors are 96 wide
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.ffn_gate\.weight' has shape \[96, 64\], metadata implies"):
        GgufCheckpoint(path).formats()


def test_unsupported_architecture(tmp_path, rng):
    w = hf_weights(rng, "llama", **DIMS)
    path = tmp_path / "g.gguf"
    write_gguf(path, "gpt2", gguf_tensors("llama", w, **DIMS), meta=False)
    ckpt = GgufCheckpoint(path)
    assert ckpt.architecture == "gpt2"
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'.*supported: llama, phi3, qwen3"):
        _ = ckpt.config


def test_truncated_file_names_the_tensor(tmp_path, rng):
    path, _, _ = make_model(tmp_path, rng, "llama")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf: tensor '.+' needs bytes up to \d+ .*truncated"):
        GgufCheckpoint(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(ModelFormatError, match=r"head\.gguf: .*truncated"):
        GgufCheckpoint(tmp_path / "head.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFormatError, match=r"x\.gguf: not a GGUF file"):
        GgufCheckpoint(tmp_path / "x.gguf")
    with pytest.raises(ModelFormatError, match="not found"):
        GgufCheckpoint(tmp_path / "missing.gguf")


def test_unknown_canonical_name(tmp_path, rng):
    path, _, _ = make_model(tmp_path, rng, "phi3")
    with pytest.raises(ModelFormatError, match=r"no weight 'layers\.0\.qkv_proj'.*similar: layers\.0\.qkv"):
        list(GgufCheckpoint(path).load(["layers.0.qkv_proj"]))


def test_mixed_qkv_whose_parts_cannot_be_bound_apart_is_refused(tmp_path, rng):
    # DIMS: q is 64 rows, k 32, so v starts at column 96 of qkv (384 bytes, not a 256-byte binding offset)
    from engine.catalog import add_local

    path, _, _ = make_model(tmp_path, rng, "llama", qtype=Q.Q5_0, types={"blk.1.attn_v.weight": Q.Q8_0})
    with pytest.raises(UnsupportedModelError, match=r"llama\.gguf: a matrix of parts in formats q5_0,q5_0,q8_0 "
                                                    r"needs each part's first output column at a multiple of 64"):
        add_local(path, tmp_path / "local.json")
