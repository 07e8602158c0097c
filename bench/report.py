"""Ratios, target checks, and the three outputs: results.json, results.md and results.png (matplotlib Agg).

Every ratio is fwd+bwd unless the column says fwd. "ours faster by" on a peer's row is peer time / our time on
the same path, shape and N (> 1: ours is faster). Rows whose check failed are never in a ratio or a target.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .geometry import is_epilogue_key, is_geometry_key

GIB = 2 ** 30
COLORS = {"erpo": "tab:blue", "erpo-ws2g": "tab:olive", "erpo-invariant": "tab:cyan", "torch": "tab:orange",
          "compile": "tab:green", "liger": "tab:red", "cce": "tab:purple"}
TARGET_ROWS = 16384
TARGET_VOCAB = 152064

# (issue, path, description, kind, peer, threshold): kind "floor" = ours / floor <= t; "speedup" = peer / ours >= t
# ("faster than" is > 1, written as threshold 1); "workspace" = workspace / bf16 logits <= t; "budget" = workspace
# bytes <= t + what the library documents as outside its workspace budget beyond the returned gradients
# (`outside_budget_bytes`). A threshold is one number for every N or a {N: number} map (no entry: the target says
# nothing at that N).
WORKSPACE_BUDGET_BYTES = 1 << 30  # issue 32: the fused path's chunk budget, default workspace_bytes
ACCUMULATOR_BYTES_PER_WEIGHT = 4  # the fp32 d weight accumulator [V, D] of a bf16 / fp16 lm_head
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # per item, of the dtypes a record names
TARGETS = (
    (32, "logits", "fwd+bwd within 1.3x (N=4096) / 1.2x of the bandwidth floor", "floor", None,
     {4096: 1.3, 16384: 1.2, 65536: 1.2}),
    (32, "logits", "faster than Liger's Triton grpo_loss", "speedup", "liger", 1.0),
    (32, "fused", "fwd+bwd within 1.5x (N=4096) / 1.2x (N=16384) of the 6NDV matmul floor", "floor", None,
     {4096: 1.5, 16384: 1.2}),
    (32, "fused", "faster than torch.compile's formula", "speedup", "compile", 1.0),
    (32, "fused", "extra memory (peak minus returned gradients) <= workspace (budget, 1 GiB) + fp32 d weight "
     "accumulator (4VD, fixed) + d hidden held in fp32 beyond the returned one (2ND, GRAD_HIDDEN_FP32 only)", "budget",
     None, WORKSPACE_BUDGET_BYTES),
    (4, "logits", ">= 4x faster than torch eager (backend='torch')", "speedup", "torch", 4.0),
    (4, "logits", ">= 1.5x faster than torch.compile", "speedup", "compile", 1.5),
    (4, "fused", "faster than CCE", "speedup", "cce", 1.0),
    (4, "fused", ">= 2x faster than Liger's fused-linear GRPO", "speedup", "liger", 2.0),
    (4, "fused", "extra peak memory <= 2% of the bf16 logits", "workspace", None, 0.02),
)


def outside_budget_bytes(row: dict) -> int:
    """Bytes of ours' fused fwd+bwd that docs/API.md (`workspace_bytes`) puts outside the workspace budget and that
    the returned gradients, subtracted from the peak, do not stand for: the fp32 d weight accumulator (4 V D) and,
    when d hidden is held from the forward to the backward in a wider dtype than the returned one (the row's
    `grad_hidden_dtype` against its inputs' `dtype`, bench.run; fp32 with GRAD_HIDDEN_FP32, the contender erpo-dh32),
    the difference (2 N D for bf16 / fp16 inputs). A row without them (a record made before bench.run wrote them)
    held d hidden in the inputs' dtype."""
    held, given = row.get("grad_hidden_dtype"), row.get("dtype")
    wider = 0 if held is None else DTYPE_BYTES[held] - DTYPE_BYTES[given]
    return (ACCUMULATOR_BYTES_PER_WEIGHT * row["V"] + wider * row["N"]) * row["D"]


def _timed(row: dict) -> bool:
    return row.get("status") == "ok" and row.get("fwdbwd_ms") is not None


def _case(row: dict) -> tuple:
    return row["path"], row["shape"], row["N"]


def add_ratios(results: dict) -> None:
    """Add x_floor_* and ours_faster_by_* to every timed row, and `speedups` and `targets` lists to `results`."""
    rows = results["rows"]
    ours = {_case(r): r for r in rows if r["ours"] and _timed(r)}
    speedups = []
    for row in rows:
        if not _timed(row):
            continue
        row["x_floor_fwd"] = row["fwd_ms"] / row["floor_fwd_ms"] if row["floor_fwd_ms"] else None
        row["x_floor_fwdbwd"] = row["fwdbwd_ms"] / row["floor_fwdbwd_ms"] if row["floor_fwdbwd_ms"] else None
        if row.get("workspace_bytes") is not None:
            row["workspace_frac_logits"] = row["workspace_bytes"] / row["logits_bytes"]
        mine = ours.get(_case(row))
        if mine is not None and not row["ours"]:
            row["ours_faster_by_fwd"] = row["fwd_ms"] / mine["fwd_ms"]
            row["ours_faster_by_fwdbwd"] = row["fwdbwd_ms"] / mine["fwdbwd_ms"]
            speedups.append({"path": row["path"], "shape": row["shape"], "N": row["N"], "peer": row["contender"],
                             "fwd": row["ours_faster_by_fwd"], "fwdbwd": row["ours_faster_by_fwdbwd"]})
    results["speedups"] = speedups
    results["targets"] = evaluate_targets(rows)


def candidate(key: str):
    """What a contender's row is a candidate for, the library's fused default it would set, or None: a chunk
    geometry (erpo-geom-*, bench.geometry: what gpu_check's bench 1 adds when the fused probe picks one), d hidden's
    dtype (erpo-dh32: fp32) or the epilogue row pass (erpo-epi, and erpo-epi-* with the epilogue probe's pick)."""
    if is_geometry_key(key):
        return "geometry"
    if key == "erpo-dh32":
        return "d hidden dtype"
    if key == "erpo-epi" or is_epilogue_key(key):
        return "epilogue row pass"
    return None


def evaluate_targets(rows: list) -> list:
    """The issues' targets on every case that has our row, and issue 32's fused-path targets on each candidate's row
    too (`candidate`), each target's `contender` saying whose row it judges; `at_target_shape` marks N=16384,
    V=152064."""
    by_case = {}
    for row in rows:
        by_case.setdefault(_case(row), {})[row["contender"]] = row
    out = []
    candidate_targets = [target for target in TARGETS if target[:2] == (32, "fused")]
    for (path, shape, rows_n), members in by_case.items():
        judged = [("erpo", target) for target in TARGETS] + [
            (key, target) for key in members if candidate(key) for target in candidate_targets]
        for subject, (issue, target_path, text, kind, peer, thresholds) in judged:
            mine = members.get(subject)
            threshold = thresholds.get(rows_n) if isinstance(thresholds, dict) else thresholds
            if target_path != path or threshold is None:
                continue
            value, verdict = None, "n/a"
            if mine is not None and _timed(mine):
                if kind == "floor":
                    value = mine["x_floor_fwdbwd"]
                    verdict = value <= threshold
                elif kind == "workspace":
                    value = mine.get("workspace_frac_logits")
                    verdict = "n/a" if value is None else value <= threshold
                elif kind == "budget":
                    threshold += outside_budget_bytes(mine)
                    value = None if mine.get("workspace_bytes") is None else mine["workspace_bytes"] / GIB
                    verdict = "n/a" if value is None else mine["workspace_bytes"] <= threshold
                else:
                    other = members.get(peer)
                    if other is not None and _timed(other):
                        value = other["fwdbwd_ms"] / mine["fwdbwd_ms"]
                        verdict = value > threshold if threshold == 1.0 else value >= threshold
            out.append({"issue": issue, "path": path, "shape": shape, "N": rows_n, "contender": subject,
                        "target": text, "value": value,
                        "threshold": threshold, "pass": verdict,
                        "at_target_shape": rows_n == TARGET_ROWS and members[next(iter(members))]["V"] == TARGET_VOCAB})
    return out


def _fmt(value, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _check_cell(row: dict) -> str:
    if "correct" not in row:
        return "-"
    worst = max((v for k, v in row.get("grad_err", {}).items() if not k.endswith("norm")), default=float("nan"))
    return f"{'yes' if row['correct'] else 'NO'} (loss {row['loss_err']:.1e}, grad {worst:.1e})"


def markdown(results: dict) -> str:
    """The results as markdown: run facts, floors, one table per path, speedup targets, column legend."""
    meta = results["meta"]
    lines = ["# erpo bench results", ""]
    if meta.get("triton_interpret") or not str(meta.get("device", "")).startswith(("NVIDIA", "AMD")):
        lines += ["**Not a GPU run: these times are no measurement of speed (Triton interpreter / CPU).**", ""]
    for key in ("device", "date", "commit", "command", "torch", "cuda", "triton", "dtype", "reps", "warmup",
                "budget_s", "peers"):
        lines.append(f"- {key}: `{meta.get(key)}`")
    lines += ["", "## Floors", "", "| path | shape | N | measured | floor fwd ms | floor fwd+bwd ms |",
              "|---|---|---|---|---|---|"]
    for f in results["floors"]:
        measured = (f"copy {f['bandwidth_Bps'] / 1e9:.1f} GB/s" if f["path"] == "logits"
                    else f"{meta.get('dtype')} matmul {f['matmul_flops'] / 1e12:.1f} TFLOP/s "
                         f"({f['matmul_rows']}x{f['D']}x{f['V']})")
        lines.append(f"| {f['path']} | {f['shape']} | {f['N']} | {measured} | {_fmt(f['floor_fwd_ms'])} | "
                     f"{_fmt(f['floor_fwdbwd_ms'])} |")
    titles = {"logits": "Logits path ([N, V] logits given)",
              "fused": "Fused-linear path (hidden [N, D], lm_head [V, D])"}
    for path in ("logits", "fused"):
        rows = [r for r in results["rows"] if r["path"] == path]
        if not rows:
            continue
        lines += ["", f"## {titles[path]}", "",
                  "| shape | N | contender | computes | status | correct (abs loss err, worst rel grad err) | "
                  "fwd ms | fwd+bwd ms | x floor (fwd+bwd) | ours faster by (fwd+bwd) | peak fwd+bwd GiB | "
                  "workspace % of bf16 logits |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            name = f"**{r['contender']}**" if r["ours"] else r["contender"]
            status = r.get("status", "-") + (f": {r['detail']}" if r.get("detail") else "")
            peak = r.get("peak_fwdbwd_bytes")
            frac = r.get("workspace_frac_logits")
            lines.append(
                f"| {r['shape']} | {r['N']} | {name} | {r['computes']} | {status.replace('|', '/')} | "
                f"{_check_cell(r)} | {_fmt(r.get('fwd_ms'))} | {_fmt(r.get('fwdbwd_ms'))} | "
                f"{_fmt(r.get('x_floor_fwdbwd'))} | {_fmt(r.get('ours_faster_by_fwdbwd'))} | "
                f"{_fmt(None if peak is None else peak / GIB)} | {_fmt(None if frac is None else 100 * frac)} |")
    if results.get("targets"):
        lines += ["", "## Targets (issues 32 and 4; bf16, V=152064; a budget's value is in GiB)", "",
                  "| issue | path | shape | N | contender | target | value | pass |", "|---" * 8 + "|"]
        for t in results["targets"]:
            verdict = t["pass"] if t["pass"] == "n/a" else ("yes" if t["pass"] else "NO")
            kind = candidate(t["contender"])
            subject = t["contender"] + (f" (candidate {kind})" if kind else "")
            lines.append(f"| {t['issue']} | {t['path']} | {t['shape']} | {t['N']} | {subject} | {t['target']} | "
                         f"{_fmt(t['value'])} | {verdict} |")
    lines += ["", "## Columns", "", LEGEND]
    return "\n".join(lines) + "\n"


LEGEND = """- **computes**: `erpo` = the ERPO loss (alpha=0.01 Query-KL, clip 0.2, query weights); `grpo` = the peer's
  GRPO loss (no Query-KL) over the same scored rows, checked against erpo_kernels' torch reference set to that loss.
- **status**: `ok`; `wrong` (check failed, not timed unless --time-wrong); `OOM`; `error` (the call raised);
  `not installed` / `unavailable` (with the reason); `not reached` (a --progress run stopped before it).
- **correct**: loss and gradients against erpo_kernels' torch reference in fp32 at the full size; gradient errors
  are ||g - ref|| / ||ref|| on query rows, response rows and dweight; unscored rows must get a zero gradient.
- **fwd ms / fwd+bwd ms**: median of --reps timed runs after --warmup runs (CUDA events on GPU), autograd on;
  fwd+bwd is the loss and `torch.autograd.grad` of it with respect to logits (or hidden and weight).
- **x floor**: time / floor. Logits floor 3*N*V*2 bytes / copy bandwidth (fwd: N*V*2 / bandwidth); fused floor
  6*N*D*V / bf16 matmul rate (fwd: 2*N*D*V / rate), both measured in this run.
- **ours faster by**: this row's fwd+bwd time / ours (erpo) on the same case; > 1 means ours is faster.
- **peak fwd+bwd GiB**: torch.cuda.max_memory_allocated during one fwd+bwd, minus what was allocated before
  (inputs excluded; the returned gradients included).
- **workspace % of bf16 logits**: peak minus the returned gradients, as a percentage of N*V*2 bytes.
"""


def write_plot(results: dict, file: Path) -> None:
    """Bar chart of fwd+bwd medians per case and contender (log scale), with each case's floor as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [p for p in ("logits", "fused") if any(r["path"] == p for r in results["rows"])]
    fig, axes = plt.subplots(len(paths) or 1, 1, figsize=(11, 4.5 * max(len(paths), 1)), squeeze=False)
    for axis, path in zip(axes[:, 0], paths):
        rows = [r for r in results["rows"] if r["path"] == path]
        cases = list(dict.fromkeys(_case(r) for r in rows))
        names = list(dict.fromkeys(r["contender"] for r in rows if _timed(r)))
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            xs, ys = [], []
            for i, case in enumerate(cases):
                match = [r for r in rows if _case(r) == case and r["contender"] == name and _timed(r)]
                if match:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(match[0]["fwdbwd_ms"])
            axis.bar(xs, ys, width=width, label=name, color=COLORS.get(name))
        for i, case in enumerate(cases):
            floor = next(r["floor_fwdbwd_ms"] for r in rows if _case(r) == case)
            axis.hlines(floor, i - 0.45, i + 0.45, colors="black", linewidth=2,
                        label="floor" if i == 0 else None)
        axis.set_xticks(range(len(cases)), [f"{shape}\nN={n}" for _, shape, n in cases])
        axis.set_yscale("log")
        axis.set_ylabel("fwd+bwd median (ms)")
        axis.set_title(f"{path} path, {results['meta'].get('device')}")
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out_dir: Path) -> dict:
    """Write results.json, results.md, results.png under `out_dir`; returns {kind: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "results.json", "md": out_dir / "results.md", "png": out_dir / "results.png"}
    files["json"].write_text(json.dumps(results, indent=1, default=str) + "\n")
    files["md"].write_text(markdown(results))
    write_plot(results, files["png"])
    return files
