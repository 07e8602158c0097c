"""bench.fused_probe's dry run on the CPU (the GPU run times the same calls): one row per variant with the plan
`plan_workspace` made for it (also in fused_probe.json), the group GEMMs' table at each group size (d hidden with
bf16 and with fp32 output, d weight's accumulation), the chunk and group rows put back after each variant, the
variants' plans at full size, and the one-line refusal without a GPU."""
import json

import pytest
import torch

from bench import fused_probe
from bench.geometry import fused_knobs
from erpo_kernels import fused_linear_loss


def test_the_dry_run_writes_a_row_per_variant(tmp_path):
    library_knobs = knobs()
    fused_probe.main(["--smoke", "--out", str(tmp_path)])
    lines = (tmp_path / "fused_probe.md").read_text().splitlines()
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line.count(" | ") == 5
            and not line.startswith("| variant")]
    assert [row[0].removeprefix("| ") for row in rows] == [name for name, *_ in fused_probe.VARIANTS]
    for _name, chunk, group, median, p20, p80 in rows:
        assert int(chunk) == int(group) == fused_probe.SMOKE["n"]  # the smoke batch fits one chunk in every budget
        assert 0 < float(p20) <= float(median) <= float(p80.removesuffix(" |"))
    part2 = lines[lines.index("One group's GEMMs by its rows G:"):]
    table = [line.removeprefix("| ").removesuffix(" |").split(" | ") for line in part2[4:part2.index("", 2)]]
    assert [int(row[0]) for row in table] == [int(rows) for rows in fused_probe.SMOKE["group_rows"].split(",")]
    for rows, *cells in table:
        assert len(cells) == 6  # d hidden with bf16 output, with fp32 output, d weight +=
        for ms, per_1000 in zip(cells[::2], cells[1::2]):  # a time and its per-1000-rows share, or a case refused
            rounding = 5e-4 * 1000 / int(rows) + 5e-4  # both cells are printed to 3 decimals
            assert (per_1000 == "-" and not ms[0].isdigit()) or (
                abs(float(ms) * 1000 / int(rows) - float(per_1000)) <= rounding and float(ms) > 0)
    assert knobs() == library_knobs
    # fused_probe.json beside it: the same rows, each with the variant's knobs, for bench.probe_pick
    measured = json.loads((tmp_path / "fused_probe.json").read_text())
    assert measured["meta"]["command"].startswith("python -m bench.fused_probe --smoke")
    (shape_rows,) = measured["shapes"].values()
    assert [(row["variant"], row["rows"], row["group"], row["gib"], row["host_layout"]) for row in shape_rows] == [
        tuple(variant) for variant in fused_probe.VARIANTS]
    assert [f"| {row['variant']} | {row['chunk_rows']} | {row['group_rows']} | {row['median_ms']:.2f} | "
            for row in shape_rows] == [line[:line.rindex(" | ", 0, line.rindex(" | ")) + 3] for line in lines
                                       if line.startswith("| ") and line.count(" | ") == 5
                                       and not line.startswith("| variant")]


def knobs():
    return fused_linear_loss.LOGITS_ROWS, fused_linear_loss.GROUP_ROWS


@pytest.mark.parametrize("hidden_dim", [3584, 5120])
def test_each_variant_gets_the_chunks_and_group_it_names(hidden_dim):
    """Under each variant's knobs the plan of the probe's problem (N = 16384, bf16, V = 152064, on CUDA) has the
    chunk rows it sets and, where it caps the group, that group (the store's, whole chunks): the GROUP_ROWS knob
    reaches `plan_workspace`."""
    for variant in fused_probe.VARIANTS:
        with fused_knobs(variant.rows, variant.group):
            plan = fused_linear_loss.plan_workspace(16384, hidden_dim, 152064, torch.bfloat16, torch.device("cuda"),
                                                    fused_linear_loss.ROW_KERNELS["triton"],
                                                    int((variant.gib or 1) * fused_probe.GIB), False)
        if variant.group is not None:
            assert (plan.chunk_rows, plan.group_rows, plan.separate_store) == (variant.rows, variant.group, True)
        elif variant.rows is not None and variant.rows < 768:  # 768 and 1024 leave no room for a store in 1 GiB
            assert plan.chunk_rows == variant.rows and plan.group_rows > 2048
    assert {(v.rows, v.group) for v in fused_probe.VARIANTS} >= {(256, None), (256, 2304), (384, 2304), (512, 1536)}


def test_the_knobs_are_put_back_when_a_variant_fails():
    library = knobs()
    variant = fused_probe.Variant("failing", rows=7, group=21)
    with pytest.raises(RuntimeError), fused_knobs(variant.rows, variant.group):
        assert knobs() == (7, 21)
        raise RuntimeError("a variant's call failed")
    assert knobs() == library


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_a_gpu_it_asks_for_smoke(tmp_path):
    with pytest.raises(SystemExit, match=r"needs a CUDA device \(or --smoke"):
        fused_probe.main(["--out", str(tmp_path)])
