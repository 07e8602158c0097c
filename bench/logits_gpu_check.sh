#!/usr/bin/env bash
# The logits path on a GPU in about 70 s, Triton compiles included (an estimate: 84 s on the H200 at e17ad62, 16 s of
# it the one-node loss's tests, which bench/gpu_check.sh's kernel tier runs whole on CUDA before this stage: they
# are no longer run here), for one short device call or as bench/gpu_check.sh's logits stage, each step under its
# own limit: the bench's logits rows for ours (the default forward and the base-2 loop; CONTENDERS overrides the
# list) and Liger at N = 16384, 4096, 65536 (60 s, of which that run took about 45; in that order: a time limit cuts
# the largest first); the host's microseconds per fwd+bwd of ours and of Liger phase by phase at N=4096 with compiled
# kernels and real launches (60 s; `python -m bench.host_cost --device cuda`, V=128: the kernels take microseconds);
# then torch.profiler's kernel table of one fwd+bwd of ours and of Liger at N=16384 (20 s; bench/kernel_profile.py). Liger comes from
# .whl/liger_kernel-*.whl when present (installed into a temporary folder, as bench/gpu_check.py does).
#
#   bash bench/logits_gpu_check.sh [--dry-run] [OUT_DIR]    # OUT_DIR default: $OUT
#
# Results: OUT_DIR/logits.jsonl (the bench's --progress rows), OUT_DIR/bench/results.{md,json,png},
# OUT_DIR/host_cost.{md,json}, OUT_DIR/profile/profile.{md,json}, OUT_DIR/logits_gpu_check.log. --dry-run: the same
# on the CPU at smoke size (Triton's interpreter): checks the script, measures nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
out="${1:-${OUT:?give OUT_DIR or set OUT}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee -a "$out/logits_gpu_check.log") 2>&1
# COMMIT: the commit to record (the GPU machine's copy of the tree has no .git of its own, or a stale one)
commit="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
echo "logits_gpu_check: commit $commit, $(date -u +%FT%TZ)"
if [ "$dry_run" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    "$python" -m bench --smoke --paths logits --contenders erpo,erpo-log2 --progress "$out/logits.jsonl" \
        --out "$out/bench" --commit "$commit"
    "$python" -m bench.host_cost --n 64 --rows-per-sample 16 --vocab 37 --reps 3 --warmup 1 \
        --json "$out/host_cost.json" --commit "$commit" > "$out/host_cost.md"
    "$python" -m bench.kernel_profile --smoke --contenders erpo,erpo-log2,liger --out "$out/profile" \
        --commit "$commit"
    exit 0
fi
wheels=(.whl/liger_kernel-*.whl)
if [ -e "${wheels[0]}" ]; then
    site="$(mktemp -d)"
    "$python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" \
        "${wheels[@]}" && export PYTHONPATH="$site:$PYTHONPATH"
fi
status=0
timeout 60 "$python" -m bench --paths logits --n 16384,4096,65536 --contenders "${CONTENDERS:-erpo,erpo-log2,liger}" \
    --budget 1 --progress "$out/logits.jsonl" --out "$out/bench" --commit "$commit" || status=$?
echo "bench: exit $status"
timeout 60 "$python" -m bench.host_cost --device cuda --n 4096 --reps 300 --json "$out/host_cost.json" \
    --commit "$commit" > "$out/host_cost.md" || echo "host_cost: exit $?"
cat "$out/host_cost.md"
timeout 20 "$python" -m bench.kernel_profile --n 16384 --contenders erpo,erpo-log2,liger --out "$out/profile" \
    --commit "$commit" || echo "kernel_profile: exit $?"
