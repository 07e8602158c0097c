"""erpo.atomic.publish, and caches shared by runs started side by side (tiny theta0, reference cache, eval samples)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from erpo.atomic import publish
from erpo.errors import UserError
from erpo.eval.sample_cache import append_lines, check_cache_meta, read_cache
from erpo.reference.cache import ReferenceCache


def write_dir(content: str):
    def write(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.txt").write_text(content)
        (tmp / "b.txt").write_text(content)
    return write


def test_publish_replaces_a_directory_whole(tmp_path):
    out = tmp_path / "sub" / "out"
    assert publish(out, write_dir("one"))
    assert publish(out, write_dir("two"))
    assert (out / "a.txt").read_text() == (out / "b.txt").read_text() == "two"
    assert [p.name for p in out.parent.iterdir()] == ["out"]       # no temporary or set-aside leftovers


def test_the_first_complete_result_wins_when_kept(tmp_path):
    out = tmp_path / "out"
    complete = lambda p: (p / "b.txt").is_file()   # noqa: E731
    assert publish(out, write_dir("first"), keep=complete)
    assert not publish(out, write_dir("second"), keep=complete)
    assert (out / "a.txt").read_text() == "first"
    out.joinpath("b.txt").unlink()                   # incomplete, not written by publish: replaced
    assert publish(out, write_dir("third"), keep=complete) and (out / "b.txt").read_text() == "third"
    file = tmp_path / "meta.json"
    assert publish(file, lambda tmp: tmp.write_text("1"), keep=os.path.isfile)
    assert not publish(file, lambda tmp: tmp.write_text("2"), keep=os.path.isfile) and file.read_text() == "1"
    assert publish(file, lambda tmp: tmp.write_text("3")) and file.read_text() == "3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "out"]


def test_a_crash_while_writing_leaves_nothing_under_the_final_name(tmp_path):
    def crash(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.txt").write_text("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        publish(tmp_path / "out", crash)
    assert list(tmp_path.iterdir()) == []
    # A process killed outright leaves its `.tmp-*` directory, which nothing takes for the result.
    script = ("import os, sys; from pathlib import Path; from erpo.atomic import publish\n"
              "def write(tmp):\n    tmp.mkdir(); (tmp / 'a.txt').write_text('half'); os._exit(9)\n"
              f"publish(Path({str(tmp_path / 'out')!r}), write)\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    assert not (tmp_path / "out").exists() and [p.name[:9] for p in tmp_path.iterdir()] == [".tmp-out."]


def test_reference_cache_saves_leave_one_whole_file(tmp_path):
    path = tmp_path / "ref.json"
    caches = [ReferenceCache("m", "fp", "t", "tfp", "plain", "p", {f"h{i}": (-1.0 * i, 0.5)}) for i in range(3)]
    for cache in caches:
        cache.save(str(path))
    assert ReferenceCache.load(str(path)).entries == caches[-1].entries
    assert [p.name for p in tmp_path.iterdir()] == ["ref.json"]


def test_eval_sample_cache_appends_and_settings_from_two_writers(tmp_path):
    directory = tmp_path / "samples"
    check_cache_meta(str(directory), {"k": 2})
    check_cache_meta(str(directory), {"k": 2})     # the second run finds the same settings
    # the user's mistake (an --output-dir of another evaluation): one line from `erpo eval`, no traceback
    with pytest.raises(UserError, match=r"different settings \(k\); use another --output-dir"):
        check_cache_meta(str(directory), {"k": 4})
    path = str(directory / "temp-1.jsonl")
    with open(path, "w") as handle:
        handle.write('{"id": 0, "sample": 0}\n{"id": 0, "sa')     # a writer killed mid-line
    append_lines(path, [{"id": 0, "sample": 1}])
    append_lines(path, [{"id": 1, "sample": 0}, {"id": 1, "sample": 1}])
    assert read_cache(path, 2) == {0: [{"id": 0, "sample": 0}, {"id": 0, "sample": 1}],
                                   1: [{"id": 1, "sample": 0}, {"id": 1, "sample": 1}]}


# Builds the tiny theta0 once all processes are ready, so that all of them find the cache cold and build it at once.
THETA0_SCRIPT = """
import hashlib, json, sys, time
from pathlib import Path
from erpo.config import Config, apply_overrides, resolve
from erpo.models.sft import tiny_theta0
cfg = resolve(apply_overrides(Config(), ["tiny.hidden_size=16", "tiny.intermediate_size=32", "tiny.num_layers=1",
    "tiny.num_heads=2", "tiny.num_kv_heads=1", "tiny.sft_steps=20", "tiny.sft_examples=64"]))
print("ready", flush=True)
while not Path(sys.argv[1]).exists():
    time.sleep(0.05)
path = Path(tiny_theta0(cfg))
print(json.dumps([str(path), hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()]))
"""


def test_three_runs_building_the_same_cold_tiny_theta0_all_succeed_and_agree(tmp_path):
    # erpo.models.sft keeps theta0 under model.cache_dir, ~/.cache/erpo by default: a fresh HOME is a cold cache.
    home, go = tmp_path / "home", tmp_path / "go"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", THETA0_SCRIPT, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    path, digest = results[0]
    assert all(r == [path, digest] for r in results)
    cache = home / ".cache" / "erpo"
    assert Path(path).parent == cache and [p.name for p in cache.iterdir()] == [Path(path).name]
    assert digest == hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()
