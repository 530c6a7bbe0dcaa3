"""MlcCheckpoint on hand-built MLC folders: manifest variants, dtypes, byte-range reads, progress, errors."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.formats.mlc import MlcCheckpoint

CONFIG = {"model_type": "phi3", "quantization": "q4f16_1", "model_config": {"hidden_size": 64}}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def encode(arr: np.ndarray, dtype: str, fmt: str) -> bytes:
    if dtype == "bfloat16" or (dtype == "float32" and fmt == "f32-to-bf16"):
        return bf16_bits(arr).tobytes()
    return np.ascontiguousarray(arr).tobytes()


def make_folder(root, shards, manifest="ndarray-cache.json", flat=False, config=CONFIG, pad=0):
    """Write an MLC folder. `shards` is a list of shards, each a list of (name, array[, dtype, format])."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "mlc-chat-config.json").write_text(json.dumps(config))
    groups = []
    for i, tensors in enumerate(shards):
        data, recs = bytearray(), []
        for entry in tensors:
            name, arr = entry[:2]
            dtype = entry[2] if len(entry) > 2 else arr.dtype.name
            fmt = entry[3] if len(entry) > 3 else "f32-to-bf16"  # what mlc-llm writes on every record
            data += b"\0" * pad
            blob = encode(arr, dtype, fmt)
            recs.append({"name": name, "shape": list(arr.shape), "dtype": dtype, "format": fmt,
                         "nbytes": len(blob), "byteOffset": len(data)})
            data += blob
        path = f"params_shard_{i}.bin"
        (root / path).write_bytes(bytes(data))
        groups.append({"dataPath": path, "format": "raw-shard", "nbytes": len(data), "records": recs,
                       "md5sum": "0" * 32})
    if flat:
        records = [{**r, "dataPath": g["dataPath"]} for g in groups for r in g["records"]]
    else:
        records = groups
    (root / manifest).write_text(json.dumps({"metadata": {"ParamSize": 0}, "records": records}))
    return root


@pytest.fixture
def arrays(rng):
    return {
        "w.q_weight": rng.integers(0, 2**32, (6, 4), dtype=np.uint32),
        "w.q_scale": rng.standard_normal((6, 1)).astype(np.float16),
        "norm.weight": rng.standard_normal(64).astype(np.float16),
        "a_log": rng.standard_normal(5).astype(np.float32),
        "ids": rng.integers(-100, 100, (3, 3)).astype(np.int8),
        "scalar": np.array(3.5, np.float32),
    }


def test_reads_every_dtype_as_written(tmp_path, arrays):
    shards = [[(n, arrays[n]) for n in ("w.q_weight", "w.q_scale", "norm.weight")],
              [(n, arrays[n], arrays[n].dtype.name, "raw") for n in ("a_log", "ids", "scalar")]]
    ckpt = MlcCheckpoint(make_folder(tmp_path / "m", shards))
    assert ckpt.names() == list(arrays)
    for name, want in arrays.items():
        got = ckpt.tensor(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_f32_to_bf16_widens_float32_only(tmp_path, rng):
    f32 = rng.standard_normal((4, 8)).astype(np.float32)
    u32 = rng.integers(0, 2**32, (4, 2), dtype=np.uint32)
    shards = [[("a", f32, "float32", "f32-to-bf16"), ("q", u32, "uint32", "f32-to-bf16"),
               ("b", f32, "bfloat16", "raw")]]
    ckpt = MlcCheckpoint(make_folder(tmp_path / "m", shards))
    rec = ckpt.record("a")
    assert rec.nbytes == f32.size * 2
    widened = (bf16_bits(f32).astype(np.uint32) << 16).view(np.float32)
    for name in ("a", "b"):
        got = ckpt.tensor(name, dtype=np.float32, shape=(4, 8))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, widened)
    # uint32 records carry the same cache-wide format tag but are stored raw.
    np.testing.assert_array_equal(ckpt.tensor("q", dtype=np.uint32), u32)


def test_flat_records_and_tensor_cache_name(tmp_path, arrays):
    root = make_folder(tmp_path / "m", [[("norm.weight", arrays["norm.weight"])], [("ids", arrays["ids"])]],
                       manifest="tensor-cache.json", flat=True)
    ckpt = MlcCheckpoint(root)
    assert ckpt.manifest_path.name == "tensor-cache.json"
    assert [ckpt.record(n).shard for n in ("norm.weight", "ids")] == [0, 1]
    np.testing.assert_array_equal(ckpt.tensor("ids"), arrays["ids"])


def test_prefers_ndarray_cache_and_ignores_b16_manifest(tmp_path, arrays):
    root = make_folder(tmp_path / "m", [[("norm.weight", arrays["norm.weight"])]])
    (root / "tensor-cache.json").write_text(json.dumps({"records": []}))
    (root / "tensor-cache-b16.json").write_text("not json")
    assert MlcCheckpoint(root).manifest_path.name == "ndarray-cache.json"
    (root / "ndarray-cache.json").unlink()
    assert MlcCheckpoint(root).manifest_path.name == "tensor-cache.json"
    (root / "tensor-cache.json").unlink()
    with pytest.raises(ModelFormatError, match="no tensor manifest"):
        MlcCheckpoint(root)


def test_config_properties(tmp_path, arrays):
    root = make_folder(tmp_path / "m", [[("ids", arrays["ids"])]])
    ckpt = MlcCheckpoint(root)
    assert ckpt.model_type == "phi3"
    assert ckpt.model_config == {"hidden_size": 64}
    assert ckpt.config["quantization"] == "q4f16_1"
    with pytest.raises(ModelFormatError, match=r"tokenizer\.json"):
        _ = ckpt.tokenizer_path
    (root / "tokenizer.json").write_text("{}")
    assert ckpt.tokenizer_path == root / "tokenizer.json"
    (root / "mlc-chat-config.json").write_text(json.dumps({"quantization": "q4f16_1"}))
    ckpt = MlcCheckpoint(root)
    with pytest.raises(ModelFormatError, match=r"mlc-chat-config\.json.*'model_type'"):
        _ = ckpt.model_type
    with pytest.raises(ModelFormatError, match=r"mlc-chat-config\.json.*'model_config'"):
        _ = ckpt.model_config


def test_load_goes_shard_by_shard_with_progress(tmp_path, rng):
    shards = [[(f"s{s}.t{t}", rng.standard_normal(16 * (t + 1)).astype(np.float16)) for t in range(3)]
              for s in range(3)]
    ckpt = MlcCheckpoint(make_folder(tmp_path / "m", shards, pad=40))
    calls = []
    wanted = ["s2.t0", "s0.t2", "s0.t0", "s2.t1"]  # shard 1 untouched, asked out of order
    got = list(ckpt.load(wanted, lambda *a: calls.append(a)))
    assert [n for n, _ in got] == ["s0.t0", "s0.t2", "s2.t0", "s2.t1"]
    for name, arr in got:
        np.testing.assert_array_equal(arr, dict(sum(shards, []))[name])
    sizes = {n: ckpt.record(n).nbytes for n in wanted}
    total = sum(sizes.values())
    assert calls == [
        (0, 2, str(tmp_path / "m" / "params_shard_0.bin"), sizes["s0.t0"] + sizes["s0.t2"], total),
        (1, 2, str(tmp_path / "m" / "params_shard_2.bin"), total, total),
    ]
    everything = list(ckpt.load())
    assert [n for n, _ in everything] == ckpt.names()


def test_load_checks_files_before_yielding(tmp_path, rng):
    shards = [[("a", rng.standard_normal(32).astype(np.float16))], [("b", np.zeros(8, np.uint32))]]
    root = make_folder(tmp_path / "m", shards)
    (root / "params_shard_1.bin").unlink()
    ckpt = MlcCheckpoint(root)
    with pytest.raises(ModelFormatError, match=r"params_shard_1\.bin.*missing.*'b'"):
        ckpt.load(["a", "b"])  # raises at the call, before any tensor is handed out
    assert [n for n, _ in ckpt.load(["a"])] == ["a"]


def test_reads_byte_ranges_not_whole_shards(tmp_path, rng):
    big = np.zeros(4 << 20, np.uint32)  # 16 MiB of other tensors in the same shard
    small = [(f"t{i}", rng.standard_normal(256).astype(np.float32), "float32", "raw") for i in range(4)]
    ckpt = MlcCheckpoint(make_folder(tmp_path / "m", [[small[0], small[1], ("big", big), *small[2:]]]))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        np.testing.assert_array_equal(ckpt.tensor("t3"), small[3][1])
        assert tracemalloc.get_traced_memory()[1] < 256 << 10
        tracemalloc.reset_peak()
        for _name, _arr in ckpt.load([n for n, *_ in small]):
            pass
        assert tracemalloc.get_traced_memory()[1] < 256 << 10
    finally:
        tracemalloc.stop()


# -- bad input: each error names the file and the tensor or field at fault ----------------------------


def _good(tmp_path, rng):
    return make_folder(tmp_path / "m", [[("w.q_weight", rng.integers(0, 9, (4, 2), dtype=np.uint32)),
                                         ("w.q_scale", np.ones((4, 1), np.float16))]])


def _edit_manifest(root, edit):
    path = root / "ndarray-cache.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_missing_folder_and_config(tmp_path, rng):
    with pytest.raises(ModelFormatError, match=r"nowhere.*not found"):
        MlcCheckpoint(tmp_path / "nowhere")
    root = _good(tmp_path, rng)
    (root / "mlc-chat-config.json").write_text("{oops")
    with pytest.raises(ModelFormatError, match=r"mlc-chat-config\.json: not valid JSON"):
        MlcCheckpoint(root)
    (root / "mlc-chat-config.json").unlink()
    with pytest.raises(ModelFormatError, match=r"mlc-chat-config\.json: missing"):
        MlcCheckpoint(root)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', "[1, 2]", '{"records": {}}'])
def test_corrupt_manifest(tmp_path, rng, text):
    root = _good(tmp_path, rng)
    (root / "ndarray-cache.json").write_text(text)
    pattern = r"ndarray-cache\.json: (not valid JSON|no 'records'|expected a JSON object)"
    with pytest.raises(ModelFormatError, match=pattern):
        MlcCheckpoint(root)


@pytest.mark.parametrize("field", ["shape", "dtype", "format", "nbytes", "byteOffset"])
def test_record_missing_field(tmp_path, rng, field):
    root = _good(tmp_path, rng)
    _edit_manifest(root, lambda m: m["records"][0]["records"][1].pop(field))
    with pytest.raises(ModelFormatError, match=rf"ndarray-cache\.json: tensor 'w\.q_scale' has no '{field}'"):
        MlcCheckpoint(root)


def test_record_missing_name_or_data_path(tmp_path, rng):
    root = _good(tmp_path, rng)
    _edit_manifest(root, lambda m: m["records"][0]["records"][0].pop("name"))
    with pytest.raises(ModelFormatError, match=r"ndarray-cache\.json: records\[0\].*records\[0\] has no 'name'"):
        MlcCheckpoint(root)
    root = _good(tmp_path / "2", rng)
    _edit_manifest(root, lambda m: m["records"][0].pop("dataPath"))
    with pytest.raises(ModelFormatError, match=r"ndarray-cache\.json: records\[0\] \(shard group\) has no 'dataPath'"):
        MlcCheckpoint(root)
    root = _good(tmp_path / "3", rng)
    _edit_manifest(root, lambda m: m.update(records=[{**m["records"][0]["records"][0]}]))  # flat, no dataPath
    with pytest.raises(ModelFormatError, match=r"tensor 'w\.q_weight' has no 'dataPath'"):
        MlcCheckpoint(root)


def test_bad_record_values(tmp_path, rng):
    cases = [
        ("nbytes", 31, r"tensor 'w\.q_scale' says nbytes=31 but shape \[4, 1\] of float16 .* needs 8"),
        ("dtype", "float8_e4m3fn", r"tensor 'w\.q_scale' has unsupported dtype 'float8_e4m3fn'"),
        ("format", "zstd", r"tensor 'w\.q_scale' has unknown format 'zstd'"),
        ("shape", [4, -1], r"tensor 'w\.q_scale' has a bad 'shape'"),
        ("dataPath", "../../etc/passwd", r"the dataPath '\.\./\.\./etc/passwd' of tensor 'w\.q_scale' is not a "
                                         r"relative path inside the model folder"),
    ]
    for i, (field, value, pattern) in enumerate(cases):
        root = _good(tmp_path / str(i), rng)
        _edit_manifest(root, lambda m, f=field, v=value: m["records"][0]["records"][1].update({f: v}))
        with pytest.raises(ModelFormatError, match=r"ndarray-cache\.json: " + pattern):
            MlcCheckpoint(root)


def test_duplicate_and_out_of_shard_records(tmp_path, rng):
    root = _good(tmp_path, rng)
    _edit_manifest(root, lambda m: m["records"][0]["records"][1].update(name="w.q_weight"))
    with pytest.raises(ModelFormatError, match=r"tensor 'w\.q_weight' is listed twice"):
        MlcCheckpoint(root)
    root = _good(tmp_path / "2", rng)
    _edit_manifest(root, lambda m: m["records"][0]["records"][1].update(byteOffset=10_000))
    with pytest.raises(ModelFormatError, match=r"tensor 'w\.q_scale' ends at byte 10008, past the 40-byte shard"):
        MlcCheckpoint(root)


def test_missing_and_truncated_shard(tmp_path, rng):
    root = _good(tmp_path, rng)
    shard = root / "params_shard_0.bin"
    shard.write_bytes(shard.read_bytes()[:35])  # the q_scale record ends at byte 40
    ckpt = MlcCheckpoint(root)
    assert ckpt.tensor("w.q_weight").shape == (4, 2)  # bytes 0..32 are still there
    with pytest.raises(ModelFormatError, match=r"params_shard_0\.bin: shard is 35 bytes but tensor 'w\.q_scale'"):
        ckpt.tensor("w.q_scale")
    with pytest.raises(ModelFormatError, match=r"params_shard_0\.bin.*'w\.q_scale'.*truncated"):
        ckpt.load()
    shard.unlink()
    with pytest.raises(ModelFormatError, match=r"params_shard_0\.bin: shard file missing .*'w\.q_weight'"):
        ckpt.tensor("w.q_weight")


def test_absent_tensor_lists_names(tmp_path, rng):
    ckpt = MlcCheckpoint(_good(tmp_path, rng))
    similar = r"ndarray-cache\.json: no tensor 'w\.q_scales'; it has 2 tensors, similar: w\.q_scale"
    with pytest.raises(ModelFormatError, match=similar):
        ckpt.tensor("w.q_scales")
    with pytest.raises(ModelFormatError, match=r"no tensor 'zzz'; it has 2 tensors, e\.g\.: w\.q_weight, w\.q_scale"):
        ckpt.load(["zzz"])


def test_expected_dtype_and_shape(tmp_path, rng):
    ckpt = MlcCheckpoint(_good(tmp_path, rng))
    assert ckpt.tensor("w.q_scale", dtype=np.float16, shape=(4, 1)).shape == (4, 1)
    wrong_dtype = r"ndarray-cache\.json: tensor 'w\.q_scale' is float16 .*expected uint32"
    with pytest.raises(ModelFormatError, match=wrong_dtype):
        ckpt.tensor("w.q_scale", dtype=np.uint32)
    with pytest.raises(ModelFormatError, match=r"tensor 'w\.q_weight' has shape \[4, 2\], expected \[4, 8\]"):
        ckpt.tensor("w.q_weight", shape=[4, 8])
