"""Stand-in files of the catalog's GGUF builds, written here, for bench/load_peak.py on a machine that downloads none.

A stand-in is what the real file is to the engine's loader: llama.cpp's tensor names and shapes for the architecture
(bench/llamacpp_gguf.py `expected`), each tensor in the GGML type the real file stores it in, F32 norms, the RoPE
tensors llama.cpp adds (Llama 3's rope_freqs, Phi-3.5's LongRoPE factors; ones here, not the file's values), and the
metadata keys the reader builds the model's config from (the catalog's dims and context, the model's RoPE base and
norm epsilon). Types: the demo's as its file has them (Q8_0 embedding, Q4_1 matrices); the Q4_K_M builds' as
llama-quantize picks them (llama_tensor_get_type): Q4_K, Q6_K for the output (or the tied embedding) and for attn_v /
ffn_down of the use_more_bits layers, Phi-3's fused attn_qkv Q5_K. The blocks are random bytes whose f16 scales
(d, and dmin / m where the type has one) are finite and sized for weights of deviation 0.5/sqrt(row length), so one
prefill through random layers stays finite. No tokenizer (host memory only; the runtime then runs on token ids).

`ensure(entry)` writes the file once into .cache/load_peak/ (git-ignored), tensor by tensor in chunks of rows, so host
RAM holds one chunk; the name carries a digest of the layout, so a changed layout is written anew.
"""

from __future__ import annotations

import hashlib
import os
import time
import zlib
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from bench.llamacpp_gguf import expected
from engine.formats import kquant

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "load_peak"
CHUNK_BYTES = 16 << 20  # rows written at a time: host RAM stays at about this

# catalog key -> what its real file has beyond the catalog's dims: the type mix, RoPE base and norm epsilon (the
# models' config.json values), and its RoPE tensors.
STANDINS = {
    "smollm2-135m-demo": dict(mix="demo", theta=100000.0, eps=1e-5),
    "qwen3-4b-q4_k_m-gguf": dict(mix="q4_k_m", theta=1000000.0, eps=1e-6),
    "phi3-mini-4k-q4_k_m-gguf": dict(mix="q4_k_m", theta=10000.0, eps=1e-5),
    "phi3.5-mini-q4_k_m-gguf": dict(mix="q4_k_m", theta=10000.0, eps=1e-5, longrope_original=4096),
    "llama3.2-3b-q4_k_m-gguf": dict(mix="q4_k_m", theta=500000.0, eps=1e-5, rope_freqs=True),
}
FILE_TYPES = {"demo": 3, "q4_k_m": 15}  # llama_ftype: MOSTLY_Q4_1, MOSTLY_Q4_K_M
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # read, not uploaded
# f16 fields of a block (byte offsets) that must be finite: the scales
HALF_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,),
               **{kquant.TYPES[tag].qtype: offs for tag, offs in kquant._HALF_FIELDS.items()}}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the first and last eighth of the layers, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def ggml_type(name: str, shape: tuple[int, ...], mix: str, layers: int, tied: bool) -> Q:
    """The type the real file stores tensor `name` in."""
    if len(shape) == 1:
        return Q.F32
    if mix == "demo":
        return Q.Q8_0 if name == "token_embd.weight" else Q.Q4_1
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    qtype = Q.Q4_K
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        qtype = Q.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(layer, layers):
        qtype = Q.Q6_K
    elif name.endswith("attn_qkv.weight"):
        qtype = Q.Q5_K
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # llama-quantize would fall back to Q5_0 / Q8_0: no catalog entry does
        raise ValueError(f"{name}: rows of {shape[-1]} are not whole {qtype.name} blocks")
    return qtype


def config(entry) -> dict:
    """bench/llamacpp_gguf.py's config of the entry's architecture, from its dims."""
    if entry.key not in STANDINS:
        raise KeyError(f"no stand-in for {entry.key!r}; have {', '.join(STANDINS)}")
    d, extra = entry.dims, STANDINS[entry.key]
    return dict(arch=entry.architecture, d=d["hidden_size"], layers=d["num_layers"], heads=d["num_heads"],
                kv_heads=d["num_kv_heads"], head_dim=d["head_dim"], ffn=d["ffn_dim"], vocab=d["vocab_size"],
                eps=extra["eps"], theta=extra["theta"], ctx=entry.max_context, tied=d["tied_embeddings"],
                qk_norm=entry.architecture == "qwen3")


def layout(entry) -> dict[str, tuple[tuple[int, ...], Q]]:
    """Every tensor of the stand-in: name -> (numpy shape, GGML type)."""
    cfg, extra = config(entry), STANDINS[entry.key]
    out = {name: (shape, ggml_type(name, shape, extra["mix"], cfg["layers"], cfg["tied"]))
           for name, (shape, _) in expected(cfg).items()}
    if extra.get("rope_freqs"):
        out["rope_freqs.weight"] = ((cfg["head_dim"] // 2,), Q.F32)
    if extra.get("longrope_original"):
        out |= {n: ((cfg["head_dim"] // 2,), Q.F32) for n in ("rope_factors_long.weight", "rope_factors_short.weight")}
    return out


def tensor_bytes(shape: tuple[int, ...], qtype: Q) -> int:
    elements, nbytes = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // elements * nbytes


def uploaded_bytes(entry) -> int:
    """What the stand-in's weights take on the GPU: every matrix's bytes as stored (the K-quant split adds none),
    the F32 norms as f16; the RoPE tensors only set the model's RoPE."""
    return sum(tensor_bytes(s, t) if t != Q.F32 else int(np.prod(s)) * 2
               for name, (s, t) in layout(entry).items() if name not in ROPE_TENSORS)


def path_for(entry, folder: Path) -> Path:
    digest = hashlib.sha1(repr((sorted((n, s, int(t)) for n, (s, t) in layout(entry).items()), config(entry),
                                STANDINS[entry.key])).encode()).hexdigest()[:8]
    return Path(folder) / f"{entry.key}-{digest}.gguf"


class _Blocks:
    """A quantized tensor's bytes, made and written a chunk of rows at a time (GGUFWriter.write_tensor_data calls
    tofile). `fill` False leaves a hole instead (a sparse file of zeros: the layout without writing the bytes)."""

    def __init__(self, name: str, shape: tuple[int, ...], qtype: Q, fill: bool):
        self.rows, self.cols = int(np.prod(shape[:-1])), shape[-1]
        self.qtype, self.fill, self.seed = qtype, fill, zlib.crc32(name.encode())
        self.nbytes = tensor_bytes(shape, qtype)

    def _chunk(self, rng, rows: int, scale: float) -> np.ndarray:
        elements, nbytes = GGML_QUANT_SIZES[self.qtype]
        blocks = rng.integers(0, 256, (rows, self.cols // elements, nbytes), dtype=np.uint8)
        for off in HALF_FIELDS[self.qtype]:  # scales of both signs, |d| in [0.5, 1)·scale
            d = rng.uniform(0.5, 1.0, blocks.shape[:2]) * rng.choice([-1.0, 1.0], blocks.shape[:2]) * scale
            blocks[:, :, off:off + 2] = d.astype("<f2").view(np.uint8).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(rows, -1)

    def tofile(self, fout) -> None:
        if not self.fill:
            fout.seek(self.nbytes - 1, os.SEEK_CUR)
            fout.write(b"\0")
            return
        rng = np.random.default_rng(self.seed)
        sample = self._chunk(rng, min(self.rows, 8), 1.0)
        scale = 0.5 / np.sqrt(self.cols) / dequantize(sample, self.qtype).std()  # values are linear in the scales
        step = max(1, CHUNK_BYTES // (self.nbytes // self.rows))
        for r0 in range(0, self.rows, step):
            self._chunk(rng, min(step, self.rows - r0), scale).tofile(fout)


def write(entry, path: Path, fill: bool = True) -> Path:
    """Write the stand-in of catalog entry `entry` to `path` (through a .part file, renamed when complete)."""
    cfg, extra, tensors = config(entry), STANDINS[entry.key], layout(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    w = GGUFWriter(str(part), cfg["arch"])
    w.add_name(f"zerotvm load_peak stand-in for {entry.key}")
    w.add_file_type(FILE_TYPES[extra["mix"]])
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(cfg["d"])
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    if extra.get("longrope_original"):  # the attention factor as convert_hf_to_gguf computes it for Phi-3.5
        original = extra["longrope_original"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(cfg["ctx"] / original) / np.log(original))))
    w.add_quantization_version(2)
    for name, (shape, qtype) in tensors.items():
        if qtype == Q.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:  # given as bytes [..., row bytes], as GGUFWriter takes quantized data
            elements, nbytes = GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // elements * nbytes)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), tensor_bytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, (shape, qtype) in tensors.items():
        if qtype == Q.F32:
            value = np.ones(shape, np.float32) if name in ROPE_TENSORS else rng.uniform(0.5, 1.5, shape)
            w.write_tensor_data(value.astype(np.float32))
        else:
            w.write_tensor_data(_Blocks(name, shape, qtype, fill))
    w.close()
    os.replace(part, path)
    return path


def ensure(entry, folder: Path | None = None) -> tuple[Path, float]:
    """(the stand-in's path in `folder`, default CACHE; seconds spent writing it: 0 when it was there). Other layouts
    of the entry there are removed."""
    folder = Path(folder or CACHE)
    path = path_for(entry, folder)
    if path.exists():
        return path, 0.0
    for old in folder.glob(f"{entry.key}-*.gguf*"):
        old.unlink()
    t = time.perf_counter()
    write(entry, path)
    return path, time.perf_counter() - t
