"""A write the storage refused (full disk, quota, I/O error, permission, read-only file system) as one line.

Such a failure is not a bug of ours: `stop_on_storage_failure` turns it into a `StorageError` (a UserError: one
line on stderr naming the path and the cause, exit status 1) and lets every other exception keep its traceback.
With several ranks, `agree_on_writes` ends each phase of writes with the ranks' agreement, so a write failing on one
rank stops all of them at once, each with one line (the others: `StoppedElsewhere`, naming that rank).
The libraries report it in three ways, all recognised by `storage_problem`:
- Python's own writes: an OSError with errno and file name;
- safetensors (Rust): "... I/O error: No space left on device (os error 28)";
- torch.save (its C++ zip writer): a RuntimeError from inline_container.cc with neither errno nor file name
  (e.g. "unexpected pos 576 vs 534" on a full tmpfs); the cause is then read from the file system's free space.
"""
from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from erpo import distributed as dist_utils
from erpo.errors import UserError

logger = logging.getLogger(__name__)

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EACCES, errno.EPERM, errno.EROFS,
                            errno.EFBIG, errno.ESTALE})
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
TORCH_WRITER_MARKS = ("inline_container", "PytorchStreamWriter", "file write failed")
NEARLY_FULL_BYTES = 1 << 20    # less free space than this after a failed torch.save: the disk was full


class StorageError(UserError):
    """The storage refused a write; the message names the path and the cause."""


class StoppedElsewhere(StorageError):
    """Another rank's write failed and this one stopped with it (that rank reports the path and the cause)."""


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_problem(exc: BaseException, directory: Path) -> str | None:
    """'PATH: CAUSE' when `exc` is a write refused by the storage under `directory`, else None (a bug of ours)."""
    for error in causes(exc):
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            return f"{error.filename or directory}: {os.strerror(error.errno)}"
        rust = RUST_OS_ERROR.search(str(error))
        if rust and int(rust.group(1)) in STORAGE_ERRNOS:
            return f"{directory}: {os.strerror(int(rust.group(1)))}"
        if isinstance(error, RuntimeError) and any(mark in str(error) for mark in TORCH_WRITER_MARKS):
            free = free_bytes(directory)
            if free is not None and free < NEARLY_FULL_BYTES:
                return f"{directory}: {os.strerror(errno.ENOSPC)}"
            return f"{directory}: torch.save could not write ({str(error).splitlines()[0]})"
    return None


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The file that keeps `path` from being a directory or from being made one (`path` itself, or its nearest
    existing parent), None when there is none."""
    nearest = next(folder for folder in (Path(path).absolute(), *Path(path).absolute().parents) if folder.exists())
    return None if nearest.is_dir() else nearest


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged process may still write on `directory`'s file system (None when unknown)."""
    for path in (directory, *directory.parents):
        try:
            stats = os.statvfs(path)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None


SAVE_ADVICE = "the previous checkpoints are intact: free space or fix the storage, then continue with --resume"


@contextmanager
def stop_on_storage_failure(what: str, directory: str | os.PathLike, advice: str = SAVE_ADVICE) -> Iterator[None]:
    """Run the block; a storage failure in it becomes StorageError("WHAT failed: PATH: CAUSE; ADVICE") (whoever
    wrote the half-written files removes them: a checkpoint save does, see `erpo.train.checkpoint`). A UserError
    raised in the block (an inner block's StorageError too) passes unchanged."""
    directory = Path(directory)
    try:
        yield
    except UserError:
        raise                 # already one line (an inner block's StorageError among them)
    except Exception as exc:
        problem = storage_problem(exc, directory)
        if problem is None:
            raise
        raise StorageError(f"{what} failed: {problem}; {advice}") from exc


def agree_on_writes(write: Callable[[], None], what: str, directory: str | os.PathLike,
                    cleanup: Callable[[], None] | None = None, advice: str = SAVE_ADVICE) -> None:
    """Run `write` (this rank's share of a phase of writes, perhaps nothing), then agree with every rank on whether
    all succeeded. Collective, in place of a barrier: a rank whose write failed must not leave the others waiting in
    a later collective it never joins (they would die with the process group's traceback when it exits).

    When a rank failed, rank 0 runs `cleanup` (e.g. removing the half-written files; best effort), every rank meets
    at a barrier (so none exits while another still works: a launcher ends the others with SIGTERM as soon as one
    exits) and raises: the rank that failed its own error (a refused write becomes one line in
    `stop_on_storage_failure`; a bug keeps its traceback), every other rank StoppedElsewhere("WHAT stopped: rank R
    could not write its files (PATH: CAUSE); ADVICE") for the first rank R that failed. A StoppedElsewhere raised in
    `write` (an inner agreement) is not this rank's own failure."""
    failure = None
    try:
        write()
    except Exception as exc:
        failure = exc
    report = None
    if failure is not None and not isinstance(failure, StoppedElsewhere):
        first_line = str(failure).splitlines()[0] if str(failure) else ""
        report = (storage_problem(failure, Path(directory)), f"{type(failure).__name__}: {first_line}")
    reports = dist_utils.all_gather_object(report)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed and failure is None:
        return
    if cleanup is not None and dist_utils.is_main():
        try:
            cleanup()
        except OSError as cleanup_error:
            logger.warning("could not remove the partial write under %s: %s", directory, cleanup_error)
    dist_utils.barrier()
    if report is not None or not failed:
        raise failure
    rank, (problem, error) = failed[0]
    if problem is not None:
        raise StoppedElsewhere(f"{what} stopped: rank {rank} could not write its files ({problem}); {advice}")
    raise StoppedElsewhere(f"{what} stopped: rank {rank} failed ({error}); see that rank's report")
