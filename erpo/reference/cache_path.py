"""Where a run's reference cache lives, checked from the config alone: before any model loads (and, on the command
line, before the trainer's modules do), so a path that cannot hold the cache is one line at once, not after
ell_theta0(q) has been computed."""
from __future__ import annotations

import os

from erpo.config import Config
from erpo.errors import UserError
from erpo.storage_errors import file_in_the_way


def reference_cache_path(cfg: Config) -> str:
    """reference.cache_path, by default OUTPUT_DIR/reference_cache.json."""
    return cfg.reference.cache_path or os.path.join(cfg.output_dir, "reference_cache.json")


def checked_cache_path(cfg: Config) -> str:
    """`reference_cache_path(cfg)`, or a UserError when it is a directory or a file stands where its directory
    would be made."""
    path = reference_cache_path(cfg)
    if os.path.isdir(path):
        raise UserError(f"reference.cache_path {path}: is a directory; give the cache file's path, e.g. "
                        f"{os.path.join(path, 'reference_cache.json')}")
    blocking = file_in_the_way(os.path.dirname(os.path.abspath(path)))
    if blocking is not None:   # found now, not by the save after ell_theta0(q) was computed
        raise UserError(f"reference.cache_path {path}: {blocking} is a file, not a directory; give a cache path (or "
                        "an --output-dir) where a directory can be made")
    return path
