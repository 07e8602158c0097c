"""A write the storage refused (full disk, quota, I/O error, permission, read-only file system) as one line.

Such a failure is not a bug of ours: `stop_on_storage_failure` turns it into a `StorageError` (a UserError: one
line on stderr naming the path and the cause, exit status 1) and lets every other exception keep its traceback.
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
def stop_on_storage_failure(what: str, directory: str | os.PathLike, cleanup: Callable[[], None] | None = None,
                            advice: str = SAVE_ADVICE) -> Iterator[None]:
    """Run the block; a storage failure in it becomes StorageError("WHAT failed: PATH: CAUSE; ADVICE"), after rank 0
    ran `cleanup` (e.g. removing the half-written checkpoint, best effort: the disk may still refuse). A UserError
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
        if cleanup is not None and dist_utils.is_main():
            try:
                cleanup()
            except OSError as cleanup_error:
                logger.warning("could not remove the partial save under %s: %s", directory, cleanup_error)
        raise StorageError(f"{what} failed: {problem}; {advice}") from exc
