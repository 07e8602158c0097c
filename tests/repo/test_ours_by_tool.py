"""summary.md's table of ours' default fused call as the probe, bench 1 and the kernel profile timed it
(bench.ours_by_tool), from made-up result files of the three (not measurements)."""
import json

from bench.ours_by_tool import ours_by_tool_lines

N = 16384


def _write_results(folder):
    probe = {"meta": {"repeats": 5, "warmup": 2, "N": N}, "shapes": {
        "qwen2.5-7b": [{"variant": "library default", "median_ms": 93.0, "p20_ms": 92.5, "p80_ms": 93.5},
                       {"variant": "workspace 2 GiB", "median_ms": 90.0, "p20_ms": 89.5, "p80_ms": 90.5}],
        "qwen2.5-32b": [{"variant": "library default", "median_ms": 132.0, "p20_ms": 131.0, "p80_ms": 134.0}]}}
    (folder / "fused_probe.json").write_text(json.dumps(probe))
    case = {"path": "fused", "shape": "qwen2.5-7b", "N": N, "status": "ok", "fwd_ms": 93.9, "fwdbwd_ms": 96.0,
            "fwdbwd_p20_ms": 95.0, "fwdbwd_p80_ms": 97.5, "fwdbwd_reps": 20, "bwd_step_ms": 0.9,
            "timed_with": ["erpo", "compile"]}
    rows = [{**case, "contender": "erpo"}, {**case, "contender": "compile", "fwdbwd_ms": 89.0},
            {**case, "contender": "erpo", "N": 4096}]
    lines = [{"meta": {"command": "python -m bench"}}, *({"row": row} for row in rows)]
    (folder / "bench.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    profile = {"meta": {"D": 3584, "N": N, "calls": 3}, "results": {"erpo": {
        "wall_us": 94100.0, "kernel_busy_us": 92000.0, "gpu_idle_us": 2100.0,
        "kernels": [{"name": "nvjet_gemm", "launches": 8, "us": 28000.0},
                    {"name": "_scale_kernel", "launches": 2, "us": 840.0}]}}}
    (folder / "profile.json").write_text(json.dumps(profile))


def test_each_tool_gets_its_row_per_shape_and_only_ours_default_call_counts(tmp_path):
    _write_results(tmp_path)
    lines = ours_by_tool_lines(tmp_path / "fused_probe.json", tmp_path / "bench.jsonl", tmp_path / "profile.json", N)
    rows = [line for line in lines if line.startswith("| qwen")]
    assert rows == [
        "| qwen2.5-7b | probe | 93.00 (92.50-93.50) | 5 after 2 | - | - | its first variant, alone |",
        "| qwen2.5-7b | bench | 96.00 (95.00-97.50) | 20 | 93.90 | 0.90 (paired per turn) | in turns with erpo, "
        "compile |",
        "| qwen2.5-7b | profile | wall 94.10 | 3 | - | 0.84 of `_scale_kernel` | kernels 92.00, GPU idle 2.10, "
        "under the profiler |",
        "| qwen2.5-32b | probe | 132.00 (131.00-134.00) | 5 after 2 | - | - | its first variant, alone |"]
    assert "paired per turn, above the profile's `_scale_kernel` time is ours' backward's" in lines[-1]


def test_without_any_tools_results_it_says_so(tmp_path):
    assert ours_by_tool_lines(tmp_path / "fused_probe.json", tmp_path / "bench.jsonl", tmp_path / "profile.json",
                              N) == ["- no tool timed ours' default call (the probe, bench 1 and the profile did not "
                                     "run or failed)"]
