"""bench.fused_probe's dry run on the CPU (the GPU run times the same calls): one row per variant with the plan
`plan_workspace` made for it, the group GEMMs' table, the chunk rows put back after each variant, and the one-line
refusal without a GPU."""
import pytest
import torch

from bench import fused_probe
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
    part2 = lines[lines.index(f"One group's GEMMs, {fused_probe.SMOKE['group_rows']} rows:"):]
    cases = [line.split(" | ")[0].removeprefix("| ") for line in part2[4:part2.index("", 2)] if line.startswith("| ")]
    assert cases == ["d hidden", "d weight += (fp32)", "d weight = (fp32, beta 0: the accumulator not read)",
                     "d weight^T += (fp32, a [D, V] accumulator)", "both, one stream", "both, two streams",
                     "d hidden, 4 vocabulary slices (bmm, sum)"]  # the group GEMMs' table (CPU: some refused)
    assert knobs() == library_knobs


def knobs():
    return (fused_linear_loss.LOGITS_ROWS,)


def test_the_knobs_are_put_back_when_a_variant_fails():
    library = knobs()
    variant = fused_probe.Variant("failing", rows=7)
    with pytest.raises(RuntimeError), fused_probe.fused_knobs(variant):
        assert knobs() == (7,)
        raise RuntimeError("a variant's call failed")
    assert knobs() == library


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_a_gpu_it_asks_for_smoke(tmp_path):
    with pytest.raises(SystemExit, match=r"needs a CUDA device \(or --smoke"):
        fused_probe.main(["--out", str(tmp_path)])
