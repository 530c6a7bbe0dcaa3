"""A GGUF laid out exactly as llama.cpp writes a Q4_K_M file: convert_hf_to_gguf's metadata keys (general.file_type
15, quantization_version 2, the tokenizer.ggml.* fields of a byte-level BPE), its tensor order (token_embd, the
blocks in the lexicographic order of the Hugging Face tensor names, so blk.10 before blk.2, output_norm last),
32-byte alignment, and llama-quantize's Q4_K_M type choice per tensor (llama_tensor_get_type: Q6_K for the tied
embedding and for attn_v / ffn_down where use_more_bits says so, Q5_0 / Q8_0 where rows are not a multiple of 256,
F32 norms). The reader, "Add local model" and load_model take it as it is.
"""

import json

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

from engine.catalog import add_local
from engine.errors import ModelFormatError
from engine.formats.gguf import GgufCheckpoint
from engine.formats.gguf_mix import file_type_formats
from engine.model import load_model
from engine.sampling import SamplingParams
from engine.tokenizer_loader import load_tokenizer
from tests.helpers import CHAT_TEMPLATE, byte_level_fields, kquant_raw, use_more_bits, write_tiny_tokenizer

DIMS = dict(dim=256, heads=4, kv_heads=2, head_dim=64, ffn=384, vocab=288, layers=12)
FILE_TYPE_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama-quantize's choice where a row is not whole 256-blocks


def q4_k_m_type(name: str, cols: int, layers: int) -> Q:
    """llama_tensor_get_type for LLAMA_FTYPE_MOSTLY_Q4_K_M on a dense model with a tied embedding."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    qtype = Q.Q4_K
    if name == "token_embd.weight":  # no output.weight: the embedding is quantized as the output
        qtype = Q.Q6_K
    elif (".attn_v." in name or ".ffn_down." in name) and use_more_bits(layer, layers):
        qtype = Q.Q6_K
    return FALLBACK[qtype] if cols % 256 else qtype


def hf_order(layers: int) -> list[str]:
    """GGUF names in the order convert_hf_to_gguf writes Qwen3: the HF names sorted (lm_head absent, tied)."""
    hf = {"input_layernorm": "attn_norm", "mlp.down_proj": "ffn_down", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "post_attention_layernorm": "ffn_norm", "self_attn.k_norm": "attn_k_norm",
          "self_attn.k_proj": "attn_k", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.q_proj": "attn_q", "self_attn.v_proj": "attn_v"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(layers):
        names |= {f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for k, v in hf.items()}
    return [names[k] for k in sorted(names)]


def write_q4_k_m(path, rng, tokenizer_dir) -> dict[str, Q]:
    d = DIMS
    shapes = {"token_embd.weight": (d["vocab"], d["dim"]), "output_norm.weight": (d["dim"],)}
    for i in range(d["layers"]):
        b = f"blk.{i}."
        q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
        shapes |= {b + "attn_norm.weight": (d["dim"],), b + "ffn_norm.weight": (d["dim"],),
                   b + "attn_q_norm.weight": (d["head_dim"],), b + "attn_k_norm.weight": (d["head_dim"],),
                   b + "attn_q.weight": (q, d["dim"]), b + "attn_k.weight": (kv, d["dim"]),
                   b + "attn_v.weight": (kv, d["dim"]), b + "attn_output.weight": (d["dim"], q),
                   b + "ffn_gate.weight": (d["ffn"], d["dim"]), b + "ffn_up.weight": (d["ffn"], d["dim"]),
                   b + "ffn_down.weight": (d["dim"], d["ffn"])}
    writer = GGUFWriter(str(path), "qwen3")  # alignment: the default 32
    writer.add_type("model")
    writer.add_name("Tiny Qwen3")
    writer.add_block_count(d["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(d["dim"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_key_length(d["head_dim"])
    writer.add_value_length(d["head_dim"])
    writer.add_file_type(FILE_TYPE_Q4_K_M)
    fields = byte_level_fields(tokenizer_dir, "qwen2", d["vocab"])
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_quantization_version(2)
    types = {}
    for name in hf_order(d["layers"]):
        shape = shapes[name]
        if len(shape) == 1:
            writer.add_tensor(name, rng.uniform(0.5, 1.5, shape).astype(np.float16).astype(np.float32))
            types[name] = Q.F32
            continue
        qtype = types[name] = q4_k_m_type(name, shape[1], d["layers"])
        if GGML_QUANT_SIZES[qtype][0] == 256:
            raw = kquant_raw(rng, qtype, *shape)
        else:
            raw = gguf_quantize(rng.normal(0, 0.05, shape).astype(np.float32), qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q4km")
    write_tiny_tokenizer(folder, DIMS["vocab"])
    # Two merges (real files have thousands): their tokens take the last two ids of the tiny vocabulary.
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for piece, (token, i) in zip(("he", "ll"), sorted(vocab.items(), key=lambda kv: kv[1])[-2:], strict=True):
        del vocab[token]
        vocab[piece] = i
    tok["model"]["merges"] = ["h e", "l l"]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    path = folder / "Tiny-Qwen3-Q4_K_M.gguf"
    return path, write_q4_k_m(path, np.random.default_rng(7), folder)


def test_the_file_is_laid_out_as_llama_cpp_writes_it(q4_k_m):
    path, types = q4_k_m
    reader = GGUFReader(path)
    names = [t.name for t in reader.tensors]
    assert names[0] == "token_embd.weight" and names[-1] == "output_norm.weight"
    assert names.index("blk.10.attn_norm.weight") < names.index("blk.2.attn_norm.weight")
    assert all(int(t.data_offset) % 32 == 0 for t in reader.tensors)
    got = {t.name: t.tensor_type for t in reader.tensors}
    assert got == types
    # the mix Q4_K_M gives this model: every type the reader must take, in one file
    assert set(types.values()) == {Q.F32, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0}
    ckpt = GgufCheckpoint(path)
    assert ckpt.metadata["general.file_type"] == FILE_TYPE_Q4_K_M and ckpt.metadata["general.quantization_version"] == 2


def test_reader_formats_follow_the_mix(q4_k_m):
    path, types = q4_k_m
    formats = GgufCheckpoint(path).runtime_formats()
    assert formats["embed"] == "q6_k" and "lm_head" not in formats
    for i in range(DIMS["layers"]):
        more = use_more_bits(i, DIMS["layers"])
        assert formats[f"layers.{i}.qkv"] == ("q4_k,q4_k,q6_k" if more else "q4_k")
        assert formats[f"layers.{i}.down"] == ("q8_0" if more else "q5_0")  # 384-wide rows: the fallbacks
        assert formats[f"layers.{i}.gate_up"] == formats[f"layers.{i}.o"] == "q4_k"
        assert formats[f"layers.{i}.attn_norm"] == "f16"
    # memfit plans a catalog Q4_K_M build from the file type alone: the same mix, fallbacks included
    dims = dict(hidden_size=DIMS["dim"], num_layers=DIMS["layers"], num_heads=DIMS["heads"], head_dim=DIMS["head_dim"],
                ffn_dim=DIMS["ffn"], tied_embeddings=True)
    mix = file_type_formats("Q4_K_M", "qwen3", dims)
    assert {n: formats[n] for n in mix} == mix and set(formats) - set(mix) == {n for n in formats if "norm" in n}


def test_add_local_model_takes_it(q4_k_m, tmp_path):
    path, types = q4_k_m
    e = add_local(path, tmp_path / "local.json")
    assert (e.format, e.architecture, e.runs) == ("gguf", "qwen3", True)
    # What the GPU holds: every matrix's GGUF bytes as stored (the K-quant split adds none), the norms as f16.
    reader = GGUFReader(path)
    expected = sum(int(t.n_bytes) if t.tensor_type != Q.F32 else int(t.n_elements) * 2 for t in reader.tensors)
    assert e.weights_bytes == expected
    assert e.total_bytes == path.stat().st_size


def test_tokenizer_from_the_file_encodes_like_tokenizer_json(q4_k_m):
    from tokenizers import Tokenizer as HFTokenizer

    path, _ = q4_k_m
    ours = load_tokenizer(path)
    theirs = HFTokenizer.from_file(str(path.parent / "tokenizer.json"))
    text = "Hello, K-quants!"
    assert ours.encode(text) == theirs.encode(text).ids


def catalog_folder(path, root):
    """A catalog download of `path`: its install folder holding the one .gguf and the catalog's generation_config."""
    from engine.catalog import all_models, install_dir, write_generation_defaults

    entry = next(e for e in all_models() if e.key == "qwen3-4b-q4_k_m-gguf")
    folder = install_dir(entry, root)
    folder.mkdir(parents=True)
    (folder / path.name).symlink_to(path)
    assert write_generation_defaults(entry, folder) == folder / "generation_config.json"
    return folder


@pytest.mark.model
@pytest.mark.slow
def test_load_model_runs_it_from_a_catalog_folder(gpu, q4_k_m, tmp_path):
    # load_model takes the folder (the file's tokenizer and template, the catalog's sampling defaults over the
    # file's, which has none), and its decode kernels agree with the prefill GEMMs on what comes next.
    path, _ = q4_k_m
    model = load_model(catalog_folder(path, tmp_path), gpu=gpu, max_context=128, q8_decode=False)
    assert model.path.name == path.name and model.tokenizer is not None
    assert model.default_sampling.temperature == 0.6  # Qwen3's, from the catalog (llama.cpp's default is 0.8)
    prompt = model.tokenizer.encode("Hello there")
    tokens = [r.token for r in model.generate(prompt, max_tokens=4, sampling=SamplingParams())]  # greedy
    logits = model.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert tokens == logits.argmax(1).tolist()


def test_a_folder_of_two_gguf_files_is_refused(q4_k_m, tmp_path):
    path, _ = q4_k_m
    folder = catalog_folder(path, tmp_path)
    (folder / "second.gguf").symlink_to(path)
    with pytest.raises(ModelFormatError, match=r"holds 2 \.gguf files .*pass the one to load"):
        load_model(folder)
