"""Identities of a model's weights (content hashes of its files, memoized per process and persisted in
~/.cache/erpo/fingerprints.json so unchanged files are not read again) and of a tokenizer (vocabulary,
normalization, chat template): what a reference cache was built with, what `erpo eval`'s samples were made with."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from erpo.atomic import publish

log = logging.getLogger("erpo")

HASH_CHUNK = 8 << 20                     # bytes read at a time when hashing a weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin")
_digests: dict[tuple[str, int, int], str] = {}   # (absolute path, size, mtime_ns) -> sha256 hex, this process


def fingerprint_cache_path() -> Path:
    """The persisted weight-file digests: $XDG_CACHE_HOME/erpo/fingerprints.json (~/.cache/erpo/ by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "erpo" / "fingerprints.json"


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's full content, streamed in HASH_CHUNK-byte pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_digest_cache(path: Path) -> dict:
    """{absolute path: [size, mtime_ns, sha256]} from the side cache; {} when absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _matches(entry, path: str) -> bool:
    """Whether a side-cache entry [size, mtime_ns, sha256] still describes the file at `path`."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return isinstance(entry, list) and len(entry) == 3 and entry[:2] == [stat.st_size, stat.st_mtime_ns]


def _persist_digests(fresh: dict[str, list]) -> None:
    """Merge `fresh` into the side cache (dropping entries of deleted or changed files) and write it atomically;
    skipped, with a debug log line, where its directory cannot be written."""
    target = fingerprint_cache_path()
    entries = {k: v for k, v in {**_read_digest_cache(target), **fresh}.items() if _matches(v, k)}
    try:
        publish(target, lambda tmp: tmp.write_text(json.dumps(entries)))
    except OSError as exc:
        log.debug("model fingerprint: weight digests not persisted to %s (%s)", target, exc)


def weight_digests(files: list[Path]) -> list[str]:
    """sha256 (hex) of each file's content: memoized in this process and persisted in `fingerprint_cache_path()`
    keyed by (absolute path, size, mtime_ns), so only new or changed files are read again."""
    side, fresh, out = None, {}, []
    for file in files:
        real = file.resolve()
        stat = real.stat()
        key = (str(real), stat.st_size, stat.st_mtime_ns)
        if key not in _digests:
            side = _read_digest_cache(fingerprint_cache_path()) if side is None else side
            entry = side.get(key[0])
            if _matches(entry, key[0]):
                _digests[key] = entry[2]
            else:
                _digests[key] = file_sha256(real)
                fresh[key[0]] = [key[1], key[2], _digests[key]]
        out.append(_digests[key])
    if fresh:
        _persist_digests(fresh)
    return out


def hub_revision(name: str) -> str | None:
    """Commit hash that `name`'s "main" resolves to in the local Hugging Face cache (offline, no download), or None
    when it is not cached there or is no valid repo id."""
    try:
        from huggingface_hub import try_to_load_from_cache
        resolved = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):
        return None
    return Path(resolved).parent.name if isinstance(resolved, str) else None


def model_fingerprint(name_or_path: str) -> str:
    """Identity of a model's weights. A local directory: sha256 over config.json, every *.index.json and the full
    content of every weight file (top-level *.safetensors / *.bin and every file an index's weight_map names,
    sub-folders included; digests cached by `weight_digests`). A hub name: "name:<name>@<commit>" when the local
    Hugging Face cache resolves its revision, else "name:<name>"."""
    path = Path(name_or_path)
    if not path.is_dir():
        commit = hub_revision(name_or_path)
        return f"name:{name_or_path}" + (f"@{commit}" if commit else "")
    digest = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    names = {p.name for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES}
    for index in sorted(path.glob("*.index.json")):
        text = index.read_bytes()
        digest.update(f"\0{index.name}\0".encode() + text)
        names.update(json.loads(text).get("weight_map", {}).values())
    names = sorted(names)
    for name, sha in zip(names, weight_digests([path / n for n in names])):
        digest.update(f"\0{name}:{sha}".encode())
    return "sha256:" + digest.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's vocabulary/normalization (its backend JSON) and its chat template."""
    backend = tokenizer.backend_tokenizer.to_str() if hasattr(tokenizer, "backend_tokenizer") else repr(tokenizer)
    text = backend + "\0" + str(getattr(tokenizer, "chat_template", None))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
