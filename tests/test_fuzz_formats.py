"""Hostile model files (issue 16): every reader attack as a regression test, then seeded fuzzers.

Each attack the adversarial review made on the model-file side is reproduced here: shard and dataPath names
leading out of the model folder, GGUF headers claiming 2^40 array elements, 2^31 tensors or 100,000 nested
arrays, configs with 1e9 layers, JSON nested 100,000 deep, values of the wrong type. Each must end in one
ModelFormatError naming the file (and field), within a small memory budget, never opening a foreign file.

The fuzzers (hypothesis) start from small valid files — a GGUF with metadata, tokenizer and tensors of four
types, an MLX folder of sharded safetensors, an MLC folder, tokenizer folders, every architecture's tiny config
— and mutate them structurally (header counts and lengths set to boundary values, JSON leaves replaced by
hostile values, deep nesting spliced in) and byte by byte (flips, cuts, insertions). Every reader entry point
must then succeed or raise ModelFormatError/UnsupportedModelError naming the file. The quick runs are
derandomized (the same examples every run, about a minute in all); `pytest -m slow` runs many more random ones.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import tempfile
import tracemalloc
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.errors import ModelFormatError, ZeroTVMError
from engine.formats import files
from engine.formats.files import read_array, safetensors_header
from engine.formats.gguf import GgufCheckpoint
from engine.formats.limits import CONFIG_LIMITS, MAX_GGUF_ARRAY, MAX_GGUF_TENSORS, MAX_JSON_DEPTH
from engine.formats.mlc import MlcCheckpoint
from engine.formats.mlx import MlxCheckpoint
from engine.models import SUPPORTED, model_module
from engine.tokenizer import Tokenizer
from engine.tokenizer_loader import load_tokenizer as load_gguf_tokenizer
from tests.helpers import DEFAULTS, write_tiny_tokenizer

Q = GGMLQuantizationType
MEMORY = 64 << 20  # peak Python/numpy allocation allowed while refusing a hostile file (files here are < 1 MB)
QUICK = settings(deadline=None, database=None, derandomize=True, max_examples=120,
                 suppress_health_check=list(HealthCheck))
SLOW = settings(QUICK, derandomize=False, max_examples=2000)
DEEP = "__DEEP__"  # stands for JSON nested 100,000 deep (json.dumps cannot write it): spliced in as text
EXTREME = [0, 1, 2, 3, 7, 8, 31, 32, 63, 64, 255, 256, 65535, 1 << 16, 1 << 24, 2**31 - 1, 2**31, 2**32 - 1,
           2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]
HOSTILE_NAMES = ["../secret.safetensors", "/etc/passwd", "..\\secret", "C:secret", "a/../../secret", "", "\0",
                 "sub/../../secret", "\\\\server\\share\\x", "//x"]


# ---- shared checks -----------------------------------------------------------------------------------

@contextmanager
def bounded_memory(limit: int = MEMORY):
    """Fail if Python/numpy allocations peak above `limit` inside the block (memory maps do not count)."""
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < limit, f"peak allocation {peak:,} bytes"


def clear_error(fn, *names: str) -> ZeroTVMError | None:
    """Run a reader: it may succeed; if it fails, it is one ModelFormatError naming every one of `names`."""
    try:
        fn()
    except ModelFormatError as e:
        message = str(e)
        assert message and len(message) < 2000 and "Traceback" not in message, message
        for name in names:
            assert name in message, f"{name!r} not named in: {message}"
        return e
    return None


def refused(fn, *names: str, match: str | None = None) -> str:
    """Like clear_error, but the reader must fail; returns the message."""
    with bounded_memory():
        e = clear_error(fn, *names)
    assert e is not None, "the hostile input was accepted"
    if match is not None:
        assert match in str(e) or __import__("re").search(match, str(e)), str(e)
    return str(e)


def json_text(value) -> str:
    return json.dumps(value).replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000)


def positions(value, at=()):
    """Every position in a JSON tree (the root included), as key/index paths."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from positions(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from positions(v, (*at, i))


def mutate_json(value, edits):
    """Apply (position index, action, new value) edits: replace or delete the chosen position."""
    value = copy.deepcopy(value)
    for index, action, new in edits:
        where = list(positions(value))
        at = where[index % len(where)]
        if not at:
            value = new
            continue
        parent = value
        for k in at[:-1]:
            parent = parent[k]
        if action == "delete" and isinstance(parent, dict):
            del parent[at[-1]]
        else:
            parent[at[-1]] = new
    return value


LEAF = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e9, 1e300, -0.0, 0.5, 32.0]),
    st.text(max_size=12), st.sampled_from(HOSTILE_NAMES + [DEEP, "~/.ssh/id_rsa", "BF16", "U32", "float16",
                                                           "f32-to-bf16"]))
JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=8)
JSON_EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(["replace", "delete"]), JSON),
                      min_size=1, max_size=3)
BYTE_EDITS = st.lists(st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 30), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=16)),
), min_size=1, max_size=4)


def edit_json_file(path: Path, edits) -> None:
    """Apply JSON edits to a file, unless earlier byte edits left it unparseable (then it stays as it is)."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, RecursionError):
        return
    path.write_text(json_text(mutate_json(value, edits)))


def mutate_bytes(data: bytes, edits) -> bytes:
    data = bytearray(data)
    for kind, at, arg in edits:
        at %= max(len(data), 1)
        if kind == "flip" and data:
            data[at] ^= arg or 0xFF
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = arg
    return bytes(data)


# ---- a small valid GGUF --------------------------------------------------------------------------------

TOKENS = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ġt", "he", "Ġthe", "<|end|>"]


def write_base_gguf(path: Path, rng: np.random.Generator) -> Path:
    """A tiny llama GGUF as llama.cpp lays it out: metadata, a byte-level BPE tokenizer, F32 norms and
    Q4_0/Q8_0/F16 matrices (K = 32)."""
    dim, heads, kv, hd, ffn, vocab = 32, 2, 1, 16, 32, len(TOKENS)
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(dim)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", TOKENS)
    w.add_array("tokenizer.ggml.token_type", [1] * (vocab - 1) + [3])
    w.add_array("tokenizer.ggml.merges", ["Ġ t", "h e", "Ġt he"])
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab - 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab - 1)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    shapes = {"token_embd.weight": ((vocab, dim), Q.Q8_0), "output_norm.weight": ((dim,), Q.F32),
              "blk.0.attn_norm.weight": ((dim,), Q.F32), "blk.0.ffn_norm.weight": ((dim,), Q.F32),
              "blk.0.attn_q.weight": ((heads * hd, dim), Q.Q4_0), "blk.0.attn_k.weight": ((kv * hd, dim), Q.Q4_0),
              "blk.0.attn_v.weight": ((kv * hd, dim), Q.Q4_0), "blk.0.attn_output.weight": ((dim, heads * hd), Q.F16),
              "blk.0.ffn_gate.weight": ((ffn, dim), Q.Q8_0), "blk.0.ffn_up.weight": ((ffn, dim), Q.Q8_0),
              "blk.0.ffn_down.weight": ((dim, ffn), Q.Q4_1)}
    for name, (shape, qtype) in shapes.items():
        data = gguf_quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def header_integers(path: Path) -> list[tuple[int, int, str]]:
    """(byte offset, width, what) of every count, length, type and offset in a GGUF header."""
    reader = GGUFReader(path)
    base = reader.data.__array_interface__["data"][0]
    out = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts:
            if part.dtype in (np.uint64, np.uint32) and part.size <= 4:
                start = part.__array_interface__["data"][0] - base
                out += [(start + i * part.itemsize, part.itemsize, field.name) for i in range(part.size)]
    return out


def read_gguf(path: Path) -> None:
    """Every entry point that opens a GGUF: header, metadata, config, spec, weights, tokenizer, catalog entry."""
    from engine.local_models import describe

    ckpt = GgufCheckpoint(path)
    assert isinstance(ckpt.metadata, dict)
    cfg = ckpt.config
    module = model_module(cfg["model_type"], where=str(path))
    module.spec(module.ModelArgs.from_dict(cfg, str(path)))
    ckpt.formats()
    for _ in ckpt.load():
        pass
    if "tokenizer.ggml.model" in ckpt.metadata:
        load_gguf_tokenizer(path).encode("the cat")
    describe(path)


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory) -> Path:
    path = write_base_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf", np.random.default_rng(16))
    read_gguf(path)  # the starting point is valid
    return path


def patched(base: Path, out: Path, edits: dict[int, tuple[int, int]]) -> Path:
    """A copy of `base` with integers overwritten: {offset: (width, value)}."""
    data = bytearray(base.read_bytes())
    for offset, (width, value) in edits.items():
        data[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    out.write_bytes(bytes(data))
    return out


def find(base: Path, field: str, nth: int = 0) -> tuple[int, int]:
    """The (offset, width) of the nth header integer of `field`."""
    hits = [(o, w) for o, w, name in header_integers(base) if name == field]
    return hits[nth]


# ---- regression: the GGUF attacks of issue 16 ------------------------------------------------------------

def test_gguf_array_of_2_to_the_40_elements(base_gguf, tmp_path):
    offset, width = find(base_gguf, "tokenizer.ggml.tokens", 3)  # key length, type, item type, length, ...
    path = patched(base_gguf, tmp_path / "a.gguf", {offset: (width, 2**40)})
    refused(lambda: GgufCheckpoint(path), "a.gguf", "tokenizer.ggml.tokens", match="1,099,511,627,776")


def test_gguf_2_to_the_31_tensors_and_2_to_the_63_keys(base_gguf, tmp_path):
    for count, what in ((8, "tensors"), (16, "metadata fields")):
        for value in (2**31, 2**63, MAX_GGUF_TENSORS + 1):
            path = patched(base_gguf, tmp_path / "c.gguf", {count: (8, value)})
            refused(lambda p=path: GgufCheckpoint(p), "c.gguf", match=what)


def test_gguf_huge_string_key_name_and_dims(base_gguf, tmp_path):
    cases = {
        "tokenizer.chat_template": (2, 2**62, "string of"),  # key length, type, the template's length
        "general.architecture": (0, 2**40, "metadata key"),  # the key's own length
    }
    for field, (nth, value, match) in cases.items():
        offset, width = find(base_gguf, field, nth)
        path = patched(base_gguf, tmp_path / "s.gguf", {offset: (width, value)})
        refused(lambda p=path: GgufCheckpoint(p), "s.gguf", match=match)
    name_len, _ = find(base_gguf, "blk.0.attn_q.weight", 0)
    n_dims, _ = find(base_gguf, "blk.0.attn_q.weight", 1)
    dim0, _ = find(base_gguf, "blk.0.attn_q.weight", 2)
    dim1, _ = find(base_gguf, "blk.0.attn_q.weight", 3)
    for edits, match in (({name_len: (8, 2**40)}, "name of"), ({n_dims: (4, 2**31)}, "dimensions"),
                         ({dim0: (8, 2**32), dim1: (8, 2**32)}, "blk.0.attn_q.weight"),  # 2^64: wraps in uint64
                         ({dim1: (8, 2**63)}, "blk.0.attn_q.weight")):
        path = patched(base_gguf, tmp_path / "d.gguf", edits)
        refused(lambda p=path: GgufCheckpoint(p), "d.gguf", match=match)


def test_gguf_tensor_offset_past_the_end_or_unaligned(base_gguf, tmp_path):
    offset, width = find(base_gguf, "blk.0.ffn_down.weight", 5)
    for value, match in ((2**40, "truncated"), (1, "alignment")):
        path = patched(base_gguf, tmp_path / "o.gguf", {offset: (width, value)})
        refused(lambda p=path: GgufCheckpoint(p), "o.gguf", "blk.0.ffn_down.weight", match=match)


def test_gguf_arrays_nested_100000_deep(tmp_path):
    body = struct.pack("<QQ", 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", GGUFValueType.ARRAY)
    body += struct.pack("<IQ", GGUFValueType.ARRAY, 1) * 100_000 + struct.pack("<IQI", GGUFValueType.UINT32, 1, 7)
    path = tmp_path / "nest.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 3) + body)
    refused(lambda: GgufCheckpoint(path), "nest.gguf", "'x'", match="nests arrays")


def test_gguf_layer_count_1e9(base_gguf, tmp_path):
    """block_count 1e9 (and 2^40 as uint64) is refused naming the field before any per-layer work."""
    offset, _ = find(base_gguf, "llama.block_count", 2)
    path = patched(base_gguf, tmp_path / "l.gguf", {offset: (4, 10**9)})
    refused(lambda: GgufCheckpoint(path).config, "l.gguf", "llama.block_count", match="1 to 1,024")
    from engine.local_models import describe
    from engine.model import load_model

    refused(lambda: describe(path), "l.gguf", "llama.block_count")
    refused(lambda: load_model(path), "l.gguf", "llama.block_count")  # fails before any GPU work


# ---- regression: paths read from files stay in the model folder ------------------------------------------

def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata=None) -> Path:
    """A safetensors file written by hand (bf16 included): {key: (dtype, shape, raw bytes)}."""
    header, blobs, offset = {}, [], 0
    for key, (dtype, shape, blob) in tensors.items():
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    return path


def bf16(rng, shape) -> bytes:
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


MLX_CONFIG = {**DEFAULTS["qwen3_5_moe"], "model_type": "qwen3_5_moe_text",
              "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                               "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}}


def write_mlx(folder: Path, rng) -> Path:
    """An MLX folder: a 4-bit matrix, an 8-bit override, bf16 and f32 vectors, split over two indexed shards."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(MLX_CONFIG))
    u32 = lambda shape: rng.integers(0, 2**32, shape, dtype=np.uint32).tobytes()  # noqa: E731
    first = {"model.embed_tokens.weight": ("U32", (8, 8), u32((8, 8))),
             "model.embed_tokens.scales": ("BF16", (8, 1), bf16(rng, (8, 1))),
             "model.embed_tokens.biases": ("BF16", (8, 1), bf16(rng, (8, 1))),
             "model.norm.weight": ("BF16", (64,), bf16(rng, (64,)))}
    second = {"model.layers.0.mlp.gate.weight": ("U32", (4, 16), u32((4, 16))),
              "model.layers.0.mlp.gate.scales": ("F16", (4, 1), np.ones((4, 1), np.float16).tobytes()),
              "model.layers.0.mlp.gate.biases": ("F32", (4, 1), np.zeros((4, 1), np.float32).tobytes()),
              "model.layers.0.linear_attn.A_log": ("F32", (4,), rng.standard_normal(4).astype("<f4").tobytes())}
    write_safetensors(folder / "model-00001-of-00002.safetensors", first, {"format": "mlx"})
    write_safetensors(folder / "model-00002-of-00002.safetensors", second, {"format": "mlx"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in second}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def read_mlx(folder: Path) -> None:
    ckpt = MlxCheckpoint(folder)
    ckpt.formats()
    for _ in ckpt.load():
        pass


@pytest.fixture
def secret(tmp_path) -> Path:
    """A foreign file beside the model folder whose first 8 bytes must never show up in a message."""
    path = tmp_path / "secret.safetensors"
    path.write_bytes(b"SECRET!!" + bytes(64))
    return path


def secret_shown(message: str) -> bool:
    n = int.from_bytes(b"SECRET!!", "little")
    return "SECRET" in message or str(n) in message or f"{n:,}" in message


@pytest.mark.parametrize("name", HOSTILE_NAMES + ["link/secret.safetensors"])
def test_mlx_index_shard_outside_the_folder(tmp_path, secret, rng, name, monkeypatch):
    folder = write_mlx(tmp_path / "model", rng)
    (folder / "link").symlink_to(tmp_path)  # a folder inside the model that leads out of it
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    opened = []
    monkeypatch.setattr("engine.formats.mlx.safetensors_header", lambda p: opened.append(p) or safetensors_header(p))
    message = refused(lambda: MlxCheckpoint(folder), "model.safetensors.index.json",
                      match="not a relative path inside the model folder")
    assert "model.norm.weight" in message and not secret_shown(message)
    assert all(p.resolve().parent == folder.resolve() for p in opened)  # the foreign file was never opened


def test_convert_index_shard_outside_the_folder(tmp_path, secret, rng):
    from engine.convert import convert_hf_to_mlc

    folder = tmp_path / "hf"
    folder.mkdir()
    config = {**DEFAULTS["llama"], "model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight":
                                                                                    "../secret.safetensors"}}))
    message = refused(lambda: convert_hf_to_mlc(folder, tmp_path / "out"), "model.safetensors.index.json",
                      "'../secret.safetensors'", match="not a relative path")
    assert not secret_shown(message) and not (tmp_path / "out").exists()


def write_mlc(folder: Path, rng, data_path: str = "params_shard_0.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "phi3", "quantization": "q4f16_1", "model_config": {**DEFAULTS["phi3"]}}
    (folder / "mlc-chat-config.json").write_text(json.dumps(config))
    arrays = [("w.q_weight", rng.integers(0, 2**32, (6, 4), dtype=np.uint32), "uint32"),
              ("w.q_scale", rng.standard_normal((6, 1)).astype(np.float16), "float16"),
              ("norm.weight", rng.standard_normal(64).astype(np.float32), "float32")]
    data, records = bytearray(), []
    for name, arr, dtype in arrays:
        blob = (arr.view(np.uint32) >> 16).astype("<u2").tobytes() if dtype == "float32" else arr.tobytes()
        records.append({"name": name, "shape": list(arr.shape), "dtype": dtype, "format": "f32-to-bf16",
                        "nbytes": len(blob), "byteOffset": len(data)})
        data += blob
    (folder / "params_shard_0.bin").write_bytes(bytes(data))
    manifest = {"metadata": {}, "records": [{"dataPath": data_path, "format": "raw-shard", "nbytes": len(data),
                                             "records": records}]}
    (folder / "ndarray-cache.json").write_text(json.dumps(manifest))
    return folder


def read_mlc(folder: Path) -> None:
    ckpt = MlcCheckpoint(folder)
    for name, _ in ckpt.load():
        ckpt.tensor(name)


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_mlc_data_path_outside_the_folder(tmp_path, secret, rng, name):
    folder = write_mlc(tmp_path / "model", rng, data_path=name)
    message = refused(lambda: read_mlc(folder), "ndarray-cache.json", match="not a relative path inside")
    assert not secret_shown(message)


def test_confined_accepts_plain_names_and_links_to_files(tmp_path):
    """The Hugging Face cache links each snapshot file into blobs/: a file link inside the folder is fine."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "abc").write_bytes(b"x")
    snap = tmp_path / "snapshots" / "rev"
    (snap / "sub").mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(tmp_path / "blobs" / "abc")
    assert files.confined(snap, "model.safetensors", "index") == snap / "model.safetensors"
    assert files.confined(snap, "sub/x.bin", "index") == snap / "sub" / "x.bin"
    assert files.confined(snap, "./sub/x.bin", "index") == snap / "sub" / "x.bin"


# ---- regression: configs and JSON ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e9, 10**9, 2**63, -1, 0, "abc", True, None, [], 1.5, float("nan")])
def test_config_layer_count(tmp_path, value):
    """num_hidden_layers 1e9 (int or float) gave a hang, a TypeError traceback, and 8 GB in `zerotvm convert`."""
    cfg = {**DEFAULTS["llama"], "model_type": "llama", "num_hidden_layers": value}
    module = model_module("llama")
    message = refused(lambda: module.spec(module.ModelArgs.from_dict(cfg, "x/config.json")), "x/config.json")
    assert "num_hidden_layers" in message


def test_convert_hostile_config_allocates_nothing(tmp_path):
    from engine.convert import convert_hf_to_mlc
    from tests.helpers import cached_tiny_hf

    src = tmp_path / "hf"
    src.mkdir()
    for f in cached_tiny_hf("llama").iterdir():
        (src / f.name).symlink_to(f)
    (src / "config.json").unlink()
    for value in (1e9, 10**9):
        (src / "config.json").write_text(json.dumps({**DEFAULTS["llama"], "model_type": "llama",
                                                     "num_hidden_layers": value}))
        refused(lambda: convert_hf_to_mlc(src, tmp_path / "out"), "config.json", "num_hidden_layers")
        (src / "config.json").unlink()
    assert not (tmp_path / "out").exists()


def test_mlc_load_refuses_hostile_config_before_the_gpu(tmp_path, rng):
    from engine.model import load_model

    folder = write_mlc(tmp_path / "m", rng)
    config = json.loads((folder / "mlc-chat-config.json").read_text())
    config["model_config"]["num_attention_heads"] = 1e9
    (folder / "mlc-chat-config.json").write_text(json.dumps(config))
    refused(lambda: load_model(folder), "mlc-chat-config.json", "num_attention_heads")


@pytest.mark.parametrize("file", ["config.json", "mlc-chat-config.json", "ndarray-cache.json",
                                  "model.safetensors.index.json", "tokenizer_config.json",
                                  "generation_config.json"])
def test_json_nested_100000_deep(tmp_path, rng, file):
    """Every JSON file a reader opens: 100,000-deep nesting is an error naming the file, not RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    if file in ("mlc-chat-config.json", "ndarray-cache.json"):
        folder = write_mlc(tmp_path / "m", rng)
        read = lambda: read_mlc(folder)  # noqa: E731
    elif file in ("config.json", "model.safetensors.index.json"):
        folder = write_mlx(tmp_path / "m", rng)
        read = lambda: read_mlx(folder)  # noqa: E731
    else:
        folder = tmp_path / "m"
        folder.mkdir()
        write_tiny_tokenizer(folder, 64)
        read = lambda: Tokenizer.from_dir(folder)  # noqa: E731
    (folder / file).write_text('{"a": ' + deep + "}")
    refused(read, file, match=f"nested 100,?001 levels deep.*limit {MAX_JSON_DEPTH}")


def test_json_nested_deep_in_local_model_config(tmp_path):
    from engine.local_models import describe

    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "model.safetensors").write_bytes(b"")
    refused(lambda: describe(tmp_path), "config.json", match="nested")


def test_wrong_types_never_escape(tmp_path, rng):
    """Values of the wrong type where the readers index, hash or compare them (unhashable bits, a string
    shape, a list for a dict) gave TypeError/KeyError tracebacks."""
    folder = write_mlx(tmp_path / "mlx", rng)
    for bad in ({"group_size": 64, "bits": [4]}, {"group_size": "64", "bits": 4}, [4, 64], "q4"):
        (folder / "config.json").write_text(json.dumps({**MLX_CONFIG, "quantization": bad}))
        refused(lambda: read_mlx(folder), "config.json")
    folder = write_mlc(tmp_path / "mlc", rng)
    manifest = json.loads((folder / "ndarray-cache.json").read_text())
    for field, bad in (("shape", "6,4"), ("shape", [2**40, 2**40]), ("shape", [1] * 99), ("name", 5),
                       ("byteOffset", 1.5), ("dtype", ["uint32"]), ("format", {"a": 1})):
        m = copy.deepcopy(manifest)
        m["records"][0]["records"][0][field] = bad
        (folder / "ndarray-cache.json").write_text(json.dumps(m))
        refused(lambda: read_mlc(folder), "ndarray-cache.json")


def test_every_whole_number_field_is_bounded():
    """Adding an architecture cannot forget a bound: each int field of each ModelArgs has a CONFIG_LIMITS entry."""
    for model_type in SUPPORTED:
        for f in fields(model_module(model_type).ModelArgs):
            if str(f.type).split("|")[0].strip() == "int":
                assert f.name in CONFIG_LIMITS, f"{model_type}: {f.name} has no bound in engine/formats/limits.py"


# ---- fuzzers ------------------------------------------------------------------------------------------

GGUF_EDITS = st.lists(st.one_of(
    st.tuples(st.just("int"), st.integers(0, 1 << 20), st.sampled_from(EXTREME)),
    st.tuples(st.just("int+"), st.integers(0, 1 << 20), st.integers(-4, 4)),
    st.tuples(st.just("bytes"), st.just(0), BYTE_EDITS),
), min_size=1, max_size=3)


def fuzz_gguf(base: Path, edits) -> None:
    data = bytearray(base.read_bytes())
    ints = header_integers(base)
    for kind, at, arg in edits:
        if kind == "bytes":
            data = bytearray(mutate_bytes(bytes(data), arg))
            continue
        offset, width, _ = ints[at % len(ints)]
        if offset + width > len(data):
            continue
        old = int.from_bytes(data[offset:offset + width], "little")
        value = arg if kind == "int" else old + arg
        data[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.gguf"
        path.write_bytes(bytes(data))
        with bounded_memory():
            clear_error(lambda: read_gguf(path), "fuzz.gguf")


@pytest.mark.slow
@QUICK
@given(GGUF_EDITS)
def test_fuzz_gguf(base_gguf, edits):
    fuzz_gguf(base_gguf, edits)


@pytest.mark.slow
@SLOW
@given(GGUF_EDITS)
def test_fuzz_gguf_long(base_gguf, edits):
    fuzz_gguf(base_gguf, edits)


GGUF_TOKENIZER_FIELDS = st.dictionaries(
    st.sampled_from(["model", "pre", "tokens", "token_type", "merges", "scores", "bos_token_id", "eos_token_id",
                     "add_bos_token", "add_space_prefix", "unknown_token_id"]),
    st.one_of(st.sampled_from(["gpt2", "llama", "qwen2", "smollm", "bert", ""]), st.text(max_size=8),
              st.integers(0, 2**32 - 1), st.booleans(),
              st.lists(st.text(max_size=6), min_size=1, max_size=40),
              st.lists(st.integers(0, 6), min_size=1, max_size=40),
              st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=40)),
    max_size=6)


def fuzz_gguf_tokenizer(fields_: dict) -> None:
    base = {"model": "llama", "tokens": ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab"],
            "scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -2.5], "token_type": [2, 3, 3, 1, 1, 1, 1, 1]}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tok.gguf"
        w = GGUFWriter(str(path), "llama")
        for key, value in {**base, **fields_}.items():
            key = "tokenizer.ggml." + key
            if isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, str):
                w.add_string(key, value)
            else:
                w.add_array(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        e = clear_error(lambda: load_gguf_tokenizer(path).encode("a ab b"), "tok.gguf")
        if e is None and not fields_:
            assert load_gguf_tokenizer(path).encode("ab")  # the base vocabulary is valid


@pytest.mark.slow
@QUICK
@given(GGUF_TOKENIZER_FIELDS)
def test_fuzz_gguf_tokenizer(fields_):
    fuzz_gguf_tokenizer(fields_)


@pytest.mark.slow
@SLOW
@given(GGUF_TOKENIZER_FIELDS)
def test_fuzz_gguf_tokenizer_long(fields_):
    fuzz_gguf_tokenizer(fields_)


SAFETENSORS_EDITS = st.lists(st.one_of(
    st.tuples(st.just("header"), JSON_EDITS),
    st.tuples(st.just("length"), st.sampled_from(EXTREME)),
    st.tuples(st.just("bytes"), BYTE_EDITS),
    st.tuples(st.just("index"), JSON_EDITS),
    st.tuples(st.just("config"), JSON_EDITS),
), min_size=1, max_size=3)


def fuzz_mlx(edits) -> None:
    """Mutate one shard's header (structurally or by bytes), the index or config.json, then read everything."""
    with tempfile.TemporaryDirectory() as d:
        folder = write_mlx(Path(d) / "m", np.random.default_rng(0))
        shard = folder / "model-00001-of-00002.safetensors"
        for kind, arg in edits:
            raw = shard.read_bytes()
            if kind == "header":
                n = int.from_bytes(raw[:8], "little")
                try:
                    header = mutate_json(json.loads(raw[8:8 + n]), arg)
                except (ValueError, RecursionError):
                    continue  # earlier byte edits broke it already
                text = json_text(header).encode()
                shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
            elif kind == "length":
                shard.write_bytes((arg % 2**64).to_bytes(8, "little") + raw[8:])
            elif kind == "bytes":
                shard.write_bytes(mutate_bytes(raw, arg))
            else:
                edit_json_file(folder / ("model.safetensors.index.json" if kind == "index" else "config.json"), arg)
        with bounded_memory():
            e = clear_error(lambda: read_mlx(folder))
            if e is None:  # the edited index may no longer send any tensor to this shard: read it directly
                header: dict = {}
                clear_error(lambda: header.update(safetensors_header(shard)), shard.name)
                for t in header.values():
                    clear_error(lambda t=t: read_array(t), shard.name)
        if e is not None:
            assert any(n in str(e) for n in (folder.name, "config.json", "index.json", "safetensors")), str(e)


@QUICK
@given(SAFETENSORS_EDITS)
# Found in CI: an index edited so no tensor points at the shard whose header was broken.
@example(edits=[("header", [(0, "replace", 0)]), ("index", [(443, "delete", None), (149362, "replace", {})])])
@example(edits=[("header", [(0, "replace", None)]), ("index", [(443, "delete", None), (149362, "replace", {})])])
def test_fuzz_mlx_safetensors(edits):
    fuzz_mlx(edits)


@pytest.mark.slow
@SLOW
@given(SAFETENSORS_EDITS)
def test_fuzz_mlx_safetensors_long(edits):
    fuzz_mlx(edits)


MLC_EDITS = st.lists(st.one_of(
    st.tuples(st.just("manifest"), JSON_EDITS),
    st.tuples(st.just("config"), JSON_EDITS),
    st.tuples(st.just("manifest-bytes"), BYTE_EDITS),
    st.tuples(st.just("shard-bytes"), BYTE_EDITS),
), min_size=1, max_size=3)


def fuzz_mlc(edits) -> None:
    from engine.local_models import describe

    with tempfile.TemporaryDirectory() as d:
        folder = write_mlc(Path(d) / "m", np.random.default_rng(0))
        for kind, arg in edits:
            file = folder / {"manifest": "ndarray-cache.json", "manifest-bytes": "ndarray-cache.json",
                             "config": "mlc-chat-config.json", "shard-bytes": "params_shard_0.bin"}[kind]
            if kind.endswith("bytes"):
                file.write_bytes(mutate_bytes(file.read_bytes(), arg))
            else:
                edit_json_file(file, arg)
        with bounded_memory():
            clear_error(lambda: read_mlc(folder))
            clear_error(lambda: describe(folder))


@QUICK
@given(MLC_EDITS)
def test_fuzz_mlc(edits):
    fuzz_mlc(edits)


@pytest.mark.slow
@SLOW
@given(MLC_EDITS)
def test_fuzz_mlc_long(edits):
    fuzz_mlc(edits)


CONFIG_CASES = st.tuples(st.sampled_from(sorted(DEFAULTS)), st.lists(st.tuples(
    st.sampled_from(sorted({f.name for t in SUPPORTED for f in fields(model_module(t).ModelArgs) if f.init}
                           | {"text_config", "rope_scaling", "rope_parameters"})), JSON), min_size=1, max_size=4))


def fuzz_config(case) -> None:
    """config.json values → ModelArgs → spec, as every loader and `zerotvm convert` build them; and the
    catalog entry of an unconverted folder holding that config."""
    from engine.local_models import describe

    model_type, edits = case
    config = {**DEFAULTS[model_type], "model_type": model_type}
    for key, value in edits:
        config[key] = value
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "config.json").write_text(json_text(config))
        (folder / "model.safetensors").write_bytes(b"")
        module = model_module(model_type)
        with bounded_memory():
            clear_error(lambda: module.spec(module.ModelArgs.from_dict(config, "config.json")), "config.json")
            clear_error(lambda: describe(folder), "config.json")


@QUICK
@given(CONFIG_CASES)
def test_fuzz_config(case):
    fuzz_config(case)


@pytest.mark.slow
@SLOW
@given(CONFIG_CASES)
def test_fuzz_config_long(case):
    fuzz_config(case)


ROPE_NUMBER = st.one_of(st.sampled_from([0, 1, 2, 4.0, 8, 32, 1e-30, 1e30, -1.0, 0.5, 64, 4096, 131072, 2**40]),
                        st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=3), st.booleans())
ROPE_SCALING = st.fixed_dictionaries({}, optional={
    "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", "longrope", "su", "dynamic",
                                  "gguf_freq_factors", "", "LINEAR"]),
    "type": st.sampled_from(["longrope", "yarn", "none"]),
    **{k: ROPE_NUMBER for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                                "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                                "rope_theta", "partial_rotary_factor")},
    **{k: st.one_of(st.lists(ROPE_NUMBER, max_size=10), st.just([1.0] * 8), ROPE_NUMBER)
       for k in ("short_factor", "long_factor", "factors")},
})
ROPE_CASES = st.tuples(st.sampled_from(["llama", "phi3", "qwen3"]), ROPE_SCALING,
                       st.sampled_from(["rope_scaling", "rope_parameters"]), ROPE_NUMBER, ROPE_NUMBER)


def fuzz_rope(case) -> None:
    """rope_scaling / rope_parameters with every field a variant reads set to hostile values, and the top-level
    rope_theta / original_max_position_embeddings they fall back on."""
    model_type, scaling, field, theta, original = case
    config = {**DEFAULTS[model_type], "model_type": model_type, field: scaling, "rope_theta": theta,
              "original_max_position_embeddings": original}
    module = model_module(model_type)
    with bounded_memory():
        clear_error(lambda: module.spec(module.ModelArgs.from_dict(config, "config.json")).rope.at(64), "config.json")


@QUICK
@given(ROPE_CASES)
def test_fuzz_rope_scaling(case):
    fuzz_rope(case)


@pytest.mark.slow
@SLOW
@given(ROPE_CASES)
def test_fuzz_rope_scaling_long(case):
    fuzz_rope(case)


TOKENIZER_EDITS = st.lists(st.one_of(
    st.tuples(st.sampled_from(["tokenizer_config.json", "generation_config.json", "config.json"]), JSON_EDITS),
    st.tuples(st.just("tokenizer.json"), BYTE_EDITS),
), min_size=1, max_size=3)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, 128)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "temperature": 0.7}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    Tokenizer.from_dir(folder)
    return folder


def fuzz_tokenizer(base: Path, edits) -> None:
    """Tokenizer files; the chat template's text is left alone (template hardening is engine/chat.py's)."""
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        for f in base.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        for file, arg in edits:
            path = folder / file
            if file == "tokenizer.json":
                path.write_bytes(mutate_bytes(path.read_bytes(), arg))
                continue
            edit_json_file(path, arg)
            try:
                value = json.loads(path.read_text()) if file == "tokenizer_config.json" else None
            except (ValueError, RecursionError):  # deep nesting spliced in: the reader must refuse it
                value = None
            if isinstance(value, dict) and isinstance(value.get("chat_template"), str):
                value["chat_template"] = json.loads(base.joinpath(file).read_text())["chat_template"]
                path.write_text(json_text(value))
        clear_error(lambda: Tokenizer.from_dir(folder).encode("hello"))


@QUICK
@given(TOKENIZER_EDITS)
def test_fuzz_tokenizer_files(tokenizer_folder, edits):
    fuzz_tokenizer(tokenizer_folder, edits)


@pytest.mark.slow
@SLOW
@given(TOKENIZER_EDITS)
def test_fuzz_tokenizer_files_long(tokenizer_folder, edits):
    fuzz_tokenizer(tokenizer_folder, edits)


def test_limits_are_far_above_real_models():
    """The bounds must never refuse a real model: the largest released values fit with room to spare."""
    real = {"num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
            "vocab_size": 262144, "max_position_embeddings": 10_485_760, "num_experts": 512, "head_dim": 256}
    for field, value in real.items():
        assert value * 2 <= CONFIG_LIMITS[field], field
    assert MAX_GGUF_ARRAY >= 4 * 262144 and math.log2(MAX_GGUF_TENSORS) >= 16
