"""Architecture files (engine/models/<arch>.py) against real checkpoints and the layering rules of issue 17.

Each tiny Hugging Face model transformers saves must be exactly what its architecture's weight table says:
every source tensor present with the shape the table gives (rows joined), and every checkpoint tensor used or
declared ignored. Adding an architecture is adding a file (shown with a throwaway one). Import directions are
checked on the source: architecture files and format readers never import the runtime or the GPU layer, the memory
estimate and the catalog take no runtime constants (they ask the runtime's own plan), the tokenizer and the GGUF
tokenizer reader do not import each other, nothing in the engine imports the app, and no test module imports
another (what tests share lives in tests/helpers.py and conftest.py).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from engine import models
from engine.errors import UnsupportedModelError
from engine.formats.files import safetensors_header
from engine.models import architectures, format_support, model_module
from engine.models.base import ATTENTION, FFNS, GATED_ATTENTION, GATED_DELTANET, MIXERS, MLP, MOE, HybridSpec
from engine.models.weights import EXPERTS, NORM, Weight
from tests.helpers import DEFAULTS, cached_tiny_hf

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("engine.transformer", "engine.hybrid", "engine.moe", "engine.gpu", "engine.matmul", "engine.attention",
           "engine.blocks", "engine.kernels", "engine.shaders", "wgpu")


def table_of(model_type: str, config: dict):
    module = model_module(model_type)
    spec = module.spec(module.ModelArgs.from_dict(config, "config.json"))
    return module, spec, module.weights(spec)


@pytest.mark.model
@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_table_matches_the_checkpoint(model_type):
    folder = cached_tiny_hf(model_type)
    config = json.loads((folder / "config.json").read_text())
    module, spec, table = table_of(config["model_type"], config)
    tensors = {}
    for f in folder.glob("*.safetensors"):
        tensors |= safetensors_header(f)
    used = set()
    for w in table:
        names = [n.format(e=e) for e in range(spec.n_experts) for n in w.hf] if "{e}" in "".join(w.hf) else w.hf
        names = [n for n in names if n in tensors] or [w.hf_fused]  # transformers 5 saves fused expert stacks
        shapes = [tensors[n].shape for n in names]
        used |= set(names)
        if w.kind == EXPERTS and "{e}" in "".join(w.hf) and names != [w.hf_fused]:
            per = len(w.hf)
            rows = sum(s[0] for s in shapes[:per])
            assert (spec.n_experts, rows, shapes[0][1]) == w.shape, w.name
        elif len(w.shape) >= 2 and w.kind != NORM:
            assert (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1]) == w.shape, (w.name, shapes)
        else:
            assert shapes == [w.shape], (w.name, shapes)
    tied = "lm_head.weight" if spec.tied_embeddings else None
    unused = [n for n in tensors if n not in used and n != tied and not n.startswith(module.HF_IGNORED)]
    assert not unused, unused
    assert spec.names == {k: v for w in table for k, v in w.mlc_tensors().items()}


@pytest.mark.parametrize("model_type", sorted(architectures()))
def test_architecture_declares_everything(model_type):
    module = model_module(model_type)
    assert model_type in module.MODEL_TYPES and set(module.FORMATS) <= {"mlc", "mlx", "gguf"}
    assert isinstance(module.CONV_TEMPLATE, str) and isinstance(module.HF_IGNORED, tuple)
    assert (module.GGUF_ARCH is not None) == ("gguf" in module.FORMATS)
    base = DEFAULTS.get(model_type.removesuffix("_text"))
    if base is None:
        return
    _, spec, table = table_of(model_type, {**base, "model_type": model_type})
    assert all(isinstance(w, Weight) and w.mlc and w.hf for w in table)
    assert all(bool(w.gguf) == ("gguf" in module.FORMATS) for w in table)
    assert all(bool(w.mlx) == ("mlx" in module.FORMATS) for w in table)
    assert len({w.name for w in table}) == len(table)
    assert len(spec.layer_blocks) == spec.n_layers and all(m in MIXERS and f in FFNS for m, f in spec.layer_blocks)


def test_layer_blocks_are_declared_per_layer():
    _, dense, _ = table_of("llama", {**DEFAULTS["llama"], "model_type": "llama"})
    assert dense.layer_blocks == ((ATTENTION, MLP),) * dense.n_layers
    cfg = {**DEFAULTS["qwen3_5_moe"], "model_type": "qwen3_5_moe_text", "mlp_only_layers": [2],
           "intermediate_size": 64}
    _, hybrid, table = table_of("qwen3_5_moe_text", cfg)
    assert isinstance(hybrid, HybridSpec)
    assert hybrid.layer_blocks == ((GATED_DELTANET, MOE), (GATED_ATTENTION, MOE), (GATED_DELTANET, MLP),
                                   (GATED_ATTENTION, MOE))
    names = {w.name for w in table}
    assert "layers.2.gate_up" in names and "layers.2.moe.router" not in names and "layers.3.moe.gate_up" in names


def test_adding_an_architecture_is_adding_a_file(tmp_path, monkeypatch):
    """A new file in engine/models/ is found, read from configs and GGUF files, and named in error messages."""
    (tmp_path / "tinyllama_like.py").write_text(
        "from engine.models.llama import ModelArgs, spec, weights  # noqa: F401\n"
        "MODEL_TYPES = ('tinyllama_like',)\nFORMATS = ('mlc', 'gguf')\nGGUF_ARCH = 'tinyllama_like'\n"
        "CONV_TEMPLATE = 'llama-3'\nHF_IGNORED = ()\n")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    models.architectures.cache_clear()
    try:
        assert model_module("tinyllama_like").GGUF_ARCH == "tinyllama_like"
        assert models.gguf_model_type("tinyllama_like") == "tinyllama_like"
        assert format_support("tinyllama_like", "mlx") is not None and format_support("tinyllama_like", "gguf") is None
        with pytest.raises(UnsupportedModelError, match="supported: .*tinyllama_like"):
            model_module("nope")
    finally:
        sys.modules.pop("engine.models.tinyllama_like", None)
        models.architectures.cache_clear()


def imports(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (lazy imports inside functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("folder", ["engine/models", "engine/formats"])
def test_declarations_and_readers_never_import_the_runtime(folder):
    for path in sorted((ROOT / folder).glob("*.py")):
        bad = [m for m in imports(path) if m.startswith(RUNTIME)]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_tokenizer_and_gguf_tokenizer_reader_do_not_import_each_other():
    assert not [m for m in imports(ROOT / "engine/formats/gguf_tokenizer.py") if m.split(".")[:2] == ["engine",
                                                                                                    "tokenizer"]]
    assert not [m for m in imports(ROOT / "engine/tokenizer.py") if m.startswith("engine.formats.gguf_tokenizer")]


@pytest.mark.parametrize("name", ["memfit.py", "memfit_stream.py", "catalog.py"])
def test_memory_estimate_and_catalog_take_no_runtime_constants(name):
    """They ask the runtime's plan (engine/transformer.py RuntimePlan) rather than copy or import its numbers."""
    constants = [m for m in imports(ROOT / "engine" / name)
                 if m.startswith(RUNTIME) and m.rsplit(".", 1)[-1].isupper()]
    assert not constants, f"engine/{name} imports {constants}"


def test_the_engine_never_imports_the_app():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        bad = [m for m in imports(path) if m == "app" or m.startswith("app.")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def imported_test_modules(source: str) -> set[str]:
    """The tests.test_* modules a test file's source imports: from tests.test_x import ..., import tests.test_x,
    from tests import test_x, and their relative forms (from .test_x import ..., from . import test_x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = "tests" + (f".{node.module}" if node.module else "") if node.level else node.module or ""
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {".".join(m.split(".")[:2]) for m in found if m.split(".")[0] == "tests"
            and len(m.split(".")) > 1 and m.split(".")[1].startswith("test_")}


def test_imported_test_modules_sees_every_form():
    source = ("from tests.test_a import f\nimport tests.test_b\nfrom tests import test_c, helpers\n"
              "from .test_d import g\nfrom . import test_e\nfrom tests.helpers import run\nimport test_f_lookalike\n"
              "def lazy():\n    from tests.test_g import h\n")
    assert imported_test_modules(source) == {f"tests.test_{x}" for x in "abcdeg"}


def test_no_test_module_imports_another():
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        bad = imported_test_modules(path.read_text())
        assert not bad, f"tests/{path.name} imports {sorted(bad)}: move what it shares into tests/helpers.py"


def test_packed_weight_is_neutral():
    assert not [m for m in imports(ROOT / "engine/packed.py") if m.startswith("engine.")]
    for path in (ROOT / "engine").glob("*.py"):
        assert "engine.formats.gguf.PackedWeight" not in imports(path), path
