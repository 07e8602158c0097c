"""Atomic publication of a file or directory that several processes may write at once (caches, exports).

`publish(out, write)` has `write` build the result under a sibling temporary name unique to this call
(`.tmp-NAME.<pid>.<random>`), makes it durable and only then gives it its final name in one rename. A reader
sees no `out`, a complete old one or a complete new one; a process killed while writing leaves only a
`.tmp-*` sibling, which nothing reads as a result. Concurrent writers never share a temporary name.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

TMP_PREFIX = ".tmp-"
PUBLISH_ATTEMPTS = 16    # renames tried while other writers keep replacing `out` (each try moves one aside)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (a file: just it)."""
    if root.is_file():
        fsync_file(root)
        return
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            fsync_file(Path(dirpath) / filename)
        fsync_dir(Path(dirpath))


def unique_sibling(path: Path, prefix: str) -> Path:
    """`path.parent / prefix+name.<pid>.<random>`: a name no other process or call picks."""
    return path.with_name(f"{prefix}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(out: str | os.PathLike, write: Callable[[Path], None], *,
            keep: Callable[[Path], bool] | None = None) -> bool:
    """Create `out` atomically: `write(tmp)` creates a file or a directory at `tmp` (a fresh sibling path that
    does not exist yet), which is fsynced and renamed to `out`; `out`'s parent directories are created.

    keep: None: our result replaces whatever `out` holds (the last writer wins). Else a predicate telling whether
    an existing `out` is a complete result: one that is wins (another process published it first) and ours is
    discarded; one that is not (left by something else) is moved aside and replaced.
    Returns whether our result was published. On an exception in `write`, the temporary path is removed.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = unique_sibling(out, TMP_PREFIX)
    try:
        write(tmp)
        fsync_tree(tmp)
        published = _install(tmp, out, keep)
    finally:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
    fsync_dir(out.parent)
    return published


def _install(tmp: Path, out: Path, keep: Callable[[Path], bool] | None) -> bool:
    """Rename `tmp` to `out` under `publish`'s rules; False when a complete `out` is kept instead."""
    for _ in range(PUBLISH_ATTEMPTS):
        if tmp.is_dir():
            try:
                os.rename(tmp, out)      # refused while `out` is a non-empty directory: never a merge
                return True
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
        elif keep is None:
            os.replace(tmp, out)         # one atomic step for a file
            return True
        else:
            try:
                os.link(tmp, out)        # fails when `out` exists: the first writer's file stays
                return True
            except FileExistsError:
                pass
        if keep is not None and keep(out):
            return False
        aside = unique_sibling(out, ".trash-")
        try:
            os.rename(out, aside)        # out of sight in one step; another writer may have moved it first
        except FileNotFoundError:
            continue
        _remove(aside)
    raise RuntimeError(f"could not publish {out}: other processes kept replacing it ({PUBLISH_ATTEMPTS} attempts)")
