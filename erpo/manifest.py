"""The manifest of a training checkpoint: every file's size and SHA-256, so a damaged one is never loaded.

`meta.json`, the file a checkpoint writes last, lists every other file of the checkpoint:
    "files": {"engine/mp_rank_00_model_states.pt": {"size": 1234, "sha256": "9f86d0..."}, ...}
and ends with `"meta_sha256"`, the SHA-256 of its own other fields (canonical JSON), so a flipped bit in meta.json
itself shows too. A file that is missing, of another size or of another digest makes the checkpoint damaged.

Digest: SHA-256 streamed in 8 MiB chunks. OpenSSL computes it with the CPU's SHA instructions (x86 SHA-NI, ARMv8
crypto), faster than BLAKE2b where those exist (the 2-core dev machine, AMD EPYC with sha_ni, 2026-11-23:
hashlib over 256 MiB in memory, sha256 0.78 GB/s vs blake2b 0.43 GB/s, machine shared), and `sha256sum` lets
a user check a file by hand. The ranks split the work: the files are dealt out by size, so each of N ranks
reads about 1/N of the bytes (estimated, not measured: a 7B checkpoint, ~100 GB at 14 bytes a parameter, on 8
ranks: ~12 GB and ~15 s per rank at that speed, plus the read). Saving digests the files right after they were
written (from the page cache); resuming checks every size on every rank (a stat) and every digest once (the rank's
share), and the ranks agree (all_gather) before anything is loaded.

A checkpoint saved before manifests existed (no "files") is loaded unchecked, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

from erpo import distributed as dist_utils
from erpo.errors import UserError

logger = logging.getLogger(__name__)

META = "meta.json"
DIGEST = "sha256"
SEAL = "meta_sha256"
CHUNK_BYTES = 8 << 20
DAMAGED_PREFIX = "damaged-"
CHECKPOINTS_DIR = "checkpoints"           # a run's checkpoints: OUTPUT_DIR/checkpoints/step-N
STEP_DIR = re.compile(r"^step-(\d+)$")


class DamagedCheckpointError(UserError):
    """No intact checkpoint to resume from, or a named checkpoint is damaged (exit status 1)."""


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint (`step-N/` holding its meta.json) in the directory `root`, oldest
    first; temporary, half-deleted and set-aside ones are left out. The trainer resumes from them, `erpo eval` reads
    a run's history from them."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / META).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def file_digest(path: Path) -> str:
    """Hex SHA-256 of a file, read in CHUNK_BYTES chunks (hashlib releases the GIL for each)."""
    digest = hashlib.new(DIGEST)
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def rank_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files (relative paths) rank `rank` of `world` digests: largest first, each to the rank with the fewest
    bytes so far (ties: lowest rank), so every rank reads about 1/world of the bytes. Same answer on every rank."""
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        owner = load.index(min(load))
        load[owner] += sizes[name]
        if owner == rank:
            mine.append(name)
    return mine


def build_manifest(directory: Path) -> dict[str, dict]:
    """{relative path: {"size", "sha256"}} of every file under `directory` but meta.json. Collective: rank 0 lists
    the files, each rank digests its share, the shares are gathered on every rank."""
    sizes = None
    if dist_utils.is_main():
        files = (path for path in sorted(directory.rglob("*")) if path.is_file() and path != directory / META)
        sizes = {path.relative_to(directory).as_posix(): path.stat().st_size for path in files}
    sizes = dist_utils.all_gather_object(sizes)[0]
    digests = {name: file_digest(directory / name)
               for name in rank_share(sizes, dist_utils.rank(), dist_utils.world_size())}
    merged = {k: v for part in dist_utils.all_gather_object(digests) for k, v in part.items()}
    return {name: {"size": sizes[name], DIGEST: merged[name]} for name in sorted(sizes)}


def seal_digest(meta: dict) -> str:
    """SHA-256 of `meta` without its seal, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed_json(meta: dict) -> str:
    """meta.json's text: `meta` plus its seal (the digest of the rest)."""
    return json.dumps({**meta, SEAL: seal_digest(meta)}, indent=1)


def read_meta(checkpoint: Path) -> tuple[dict | None, str | None]:
    """(meta, None) when meta.json reads and its seal matches (an older meta.json, without manifest or seal, is taken
    as it is); (None, "meta.json: WHY") otherwise."""
    try:
        meta = json.loads((checkpoint / META).read_text())
    except FileNotFoundError:
        return None, f"{META}: missing"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{META}: unreadable ({exc})"
    if not isinstance(meta, dict):
        return None, f"{META}: not a JSON object"
    if SEAL not in meta and "files" in meta:   # both are written together: a damaged key
        return None, f"{META}: its digest ({SEAL}) is missing"
    if SEAL in meta and meta[SEAL] != seal_digest(meta):
        return None, f"{META}: its content does not match its digest (altered after it was written)"
    return meta, None


def size_problem(checkpoint: Path, name: str, entry: dict) -> str | None:
    """Why file `name` of the manifest is missing or of the wrong size (None when it is right)."""
    try:
        size = (checkpoint / name).stat().st_size
    except OSError as exc:
        return f"{name}: {exc.strerror or exc}"
    if size != entry["size"]:
        return f"{name}: {size} bytes, {entry['size']} expected (truncated or overwritten)"
    return None


def local_problem(checkpoint: Path, *, only: str = "", digests: bool = True) -> str | None:
    """What this rank finds wrong with `checkpoint` (None: nothing): meta.json, then every listed file's size, then
    the digests of this rank's share of the files. `only`: check just the files under this prefix (e.g. "hf/").
    digests=False: sizes only (a stat per file)."""
    meta, problem = read_meta(checkpoint)
    if problem:
        return problem
    files = meta.get("files")
    if files is None:
        return None
    files = {name: entry for name, entry in files.items() if name.startswith(only)}
    for name, entry in files.items():
        problem = size_problem(checkpoint, name, entry)
        if problem:
            return problem
    if not digests:
        return None
    share = rank_share({n: e["size"] for n, e in files.items()}, dist_utils.rank(), dist_utils.world_size())
    for name in share:
        if file_digest(checkpoint / name) != files[name][DIGEST]:
            return f"{name}: its content does not match its {DIGEST} (bit rot or an overwritten file)"
    return None


def agreed_problem(checkpoint: Path) -> str | None:
    """`local_problem` of every rank, gathered: the first rank's problem, or None when all found the checkpoint
    intact. Collective: every rank gets the same answer."""
    found = dist_utils.all_gather_object(local_problem(checkpoint))
    return next((problem for problem in found if problem), None)


def warn_if_unchecked(checkpoint: Path) -> None:
    meta, _ = read_meta(checkpoint)
    if meta is not None and "files" not in meta and dist_utils.is_main():
        logger.warning("checkpoint %s has no manifest (saved by an older erpo): loaded without checking its files",
                       checkpoint)


def newest_intact(checkpoints: list[Path]) -> Path | None:
    """The newest of `checkpoints` (complete ones, oldest first, as rank 0 lists them) whose files are intact on
    every rank; None when the list is empty. Each newer damaged one is named in one warning line and moved aside to
    `damaged-step-N` (so the resumed run saves that step afresh, and the user can inspect it). None intact: a
    DamagedCheckpointError naming each, and nothing is moved. Collective."""
    checkpoints = dist_utils.all_gather_object([str(p) for p in checkpoints])[0]
    damaged = []
    for checkpoint in map(Path, reversed(checkpoints)):
        problem = agreed_problem(checkpoint)
        if problem is None:
            for skipped, why in damaged:
                set_aside(skipped, why)
            warn_if_unchecked(checkpoint)
            return checkpoint
        damaged.append((checkpoint, problem))
    if not damaged:
        return None
    raise none_intact(damaged)


def set_aside(checkpoint: Path, problem: str) -> None:
    """Rank 0 renames a damaged checkpoint to `damaged-step-N` (`.1`, `.2`, ... when taken) with one warning line;
    every rank waits for it."""
    if dist_utils.is_main():
        aside = checkpoint.with_name(DAMAGED_PREFIX + checkpoint.name)
        n = 0
        while aside.exists():
            n += 1
            aside = checkpoint.with_name(f"{DAMAGED_PREFIX}{checkpoint.name}.{n}")
        checkpoint.rename(aside)
        logger.warning("checkpoint %s is damaged (%s): skipped, moved to %s; resuming from an older one",
                       checkpoint, problem, aside.name)
    dist_utils.barrier()


def require_intact(checkpoint: str | os.PathLike, *, only: str = "") -> None:
    """DamagedCheckpointError naming the damaged file when `checkpoint` (its files under `only`) is not intact.
    Collective when `only` is empty (every rank checks its share); one process otherwise."""
    checkpoint = Path(checkpoint)
    problem = agreed_problem(checkpoint) if not only else local_problem(checkpoint, only=only)
    if problem:
        raise DamagedCheckpointError(f"checkpoint {checkpoint} is damaged: {problem}")
    warn_if_unchecked(checkpoint)


def newest_sound_meta(checkpoints: list[Path]) -> dict:
    """The meta of the newest of `checkpoints` (oldest first) whose meta.json and file sizes are sound, read by this
    process alone before any rank loads a model (the digests are checked later, by `newest_intact`).
    DamagedCheckpointError when none is."""
    damaged = []
    for checkpoint in reversed(checkpoints):
        problem = local_problem(checkpoint, digests=False)
        if problem is None:
            return read_meta(checkpoint)[0]
        damaged.append((checkpoint, problem))
    raise none_intact(damaged)


def none_intact(damaged: list[tuple[Path, str]]) -> DamagedCheckpointError:
    """The one-line error for a run directory whose checkpoints (path, problem; newest first) are all damaged."""
    return DamagedCheckpointError(f"no intact checkpoint under {damaged[0][0].parent}: "
                                  + "; ".join(f"{path.name}: {why}" for path, why in damaged)
                                  + "; restore them from a copy, or start a fresh run in another --output-dir")
