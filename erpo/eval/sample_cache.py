"""The sample cache of `erpo eval`: `OUTPUT_DIR/samples/MODEL/BENCHMARK/temp-T.jsonl`, appended one chunk of
problems at a time (so an interrupted evaluation resumes where it stopped), with the settings the samples were
made with (a cache made with other settings is refused) and a seed per chunk."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import zlib

from erpo.atomic import publish
from erpo.errors import UserError
from erpo.eval.problem_sets import Benchmark
from erpo.records import iter_jsonl


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)


def cache_dir(output_dir: str, model: str, benchmark: str) -> str:
    """Directory holding the samples of one (model, benchmark) and the settings they were made with."""
    return os.path.join(output_dir, "samples", _safe(model), _safe(benchmark))


def cache_path(output_dir: str, model: str, benchmark: str, temperature: float) -> str:
    """JSONL file holding the samples of one (model, benchmark, temperature)."""
    return os.path.join(cache_dir(output_dir, model, benchmark), f"temp-{temperature:g}.jsonl")


def read_cache(path: str, k: int) -> dict[int, list[dict]]:
    """Problems whose k samples are all in the cache: ``{problem id: [sample 0..k-1 records]}``.

    A torn last line (crash while writing) is ignored; for a repeated (id, sample) the last line wins.
    """
    if not os.path.isfile(path):
        return {}
    samples: dict[int, dict[int, dict]] = {}
    for _, record in iter_jsonl(path, torn_tail_ok=True):
        samples.setdefault(int(record["id"]), {})[int(record["sample"])] = record
    return {pid: [by_index[j] for j in range(k)] for pid, by_index in samples.items()
            if all(j in by_index for j in range(k))}


def append_lines(path: str, records: list[dict]) -> None:
    """Append records as JSON lines and fsync; a torn last line left by a crash is cut off first (the file is
    read whole only then: each chunk's append costs its own size, not the cache's)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab+") as handle:
        # An append-only log cannot be published whole without rewriting it: evaluations sharing an output dir
        # take turns instead, so none cuts off as torn the lines another is still writing.
        fcntl.flock(handle, fcntl.LOCK_EX)
        size = handle.seek(0, os.SEEK_END)
        if size:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":  # torn: only then is the whole file read, to find its last newline
                handle.seek(0)
                handle.truncate(handle.read().rfind(b"\n") + 1)
        handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def check_cache_meta(directory: str, meta: dict) -> None:
    """Write the sampling settings next to the cache, or refuse to mix samples made with others. Of evaluations
    starting at once, the first to publish its settings sets them for all (`erpo.atomic.publish`)."""
    path = os.path.join(directory, "cache_meta.json")
    if not os.path.isfile(path):
        publish(path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8"),
                keep=os.path.isfile)
    with open(path, encoding="utf-8") as handle:
        old = json.load(handle)
    changed = sorted(key for key in set(old) | set(meta) if old.get(key) != meta.get(key))
    if changed:   # the user's: an --output-dir that holds another evaluation's samples
        unrecorded = [key for key in changed if key not in old]   # an older erpo's cache: it cannot be checked
        why = f"by an erpo that did not record {', '.join(unrecorded)}" if unrecorded else "with different settings"
        raise UserError(f"sample cache {directory} was made {why} ({', '.join(changed)}); use another --output-dir "
                        "or delete that directory")


def problems_fingerprint(bench: Benchmark) -> str:
    text = json.dumps([[p["id"], p["problem"], p["answers"]] for p in bench.problems], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chunk_seed(seed: int, benchmark: str, temperature: float, start: int) -> int:
    """Sampling seed of the chunk of problems starting at ``start`` (stable across runs and resumes)."""
    return (seed * 1_000_003 + zlib.crc32(f"{benchmark}|{temperature:g}|{start}".encode())) % (2**31 - 1)
