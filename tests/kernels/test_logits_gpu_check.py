"""bench/logits_gpu_check.sh --dry-run (the logits path's short GPU check, on the CPU at smoke size) writes the
bench rows of ours and the kernel-profile tables it will write on a GPU. It runs in its own processes with
TRITON_INTERPRET=1 (on a GPU machine too); nothing it times is asserted on."""
import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_bench_rows_and_the_kernel_tables(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"COMMIT": "0123abc"}
    done = subprocess.run(["bash", str(REPO / "bench" / "logits_gpu_check.sh"), "--dry-run", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line)["row"] for line in (tmp_path / "logits.jsonl").read_text().splitlines()
            if '"row"' in line]
    assert {row["contender"]: row["status"] for row in rows} == {"erpo": "ok", "erpo-log2": "ok"}
    assert (tmp_path / "bench" / "results.md").exists()
    host_cost = json.loads((tmp_path / "host_cost.json").read_text())
    assert host_cost["args"]["device"] == "cpu" and host_cost["results"]["erpo"]["triton_launches"] == 4
    assert host_cost["meta"]["commit"] == "0123abc"
    assert "| total |" in (tmp_path / "host_cost.md").read_text()
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["meta"]["commit"] == "0123abc"  # COMMIT wins over whatever .git the machine's copy holds
    assert profile["meta"]["device"] == "cpu"
    assert f"--out {tmp_path / 'profile'} " in profile["meta"]["command"] + " "
    for key in ("erpo", "erpo-log2"):
        result = profile["results"][key]
        assert result["wall_us"] > 0
        # the loss's forward: one autograd node (`_LogitsLoss`) where nothing traces, the logp/entropy op otherwise
        assert any(name in row["name"] for row in result["kernels"] for name in ("_LogitsLoss", "logp_entropy")), \
            result["kernels"]
    assert isinstance(profile["results"]["liger"], (str, dict))  # "not installed: ..." without its wheel
    markdown = (tmp_path / "profile" / "profile.md").read_text()
    assert "## erpo\n" in markdown and "## liger\n" in markdown
    assert "logits_gpu_check: commit 0123abc" in (tmp_path / "logits_gpu_check.log").read_text()
