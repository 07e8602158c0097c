#!/usr/bin/env bash
# The one command of a GPU lease (bench/README.md, "One command for a GPU lease"): the kernel tier on CUDA, the
# fused path's probe (bench.fused_probe), the fused path's targets (bench 1), the logits check
# (bench/logits_gpu_check.sh), 20 steps of `erpo train`, the fused path's profile and the rest of the bench table,
# each stage under its own time limit, all within 570 s, with nvidia-smi sampling the GPU's clocks, power,
# temperature and clock-limit reasons once a second throughout (bench/gpu_clocks.py); 8 result files in OUT_DIR
# (default: $OUT, the device machine's result folder; the device tool brings back 8 at most), clocks.csv among them
# (7 in the dry run, which samples nothing). The stages are bench/gpu_check.py.
#
#   bash bench/gpu_check.sh [--dry-run] [--commit HASH] [--stages kernels,probe,logits,train,profile,bench]
#                           [--deadline SECONDS] [OUT_DIR]
#
# PYTHON picks the interpreter (default python3, which on the GPU image is the one holding torch).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m bench.gpu_check "$@"
