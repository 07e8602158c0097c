"""Compile for sm_90 each Triton launch a JSON file lists (`compile_check.launch_specializations`, argv[1]), as the
launcher would compile it, and print one JSON line per launch: its kernel and `compile_check.reduction_layouts`
(run without TRITON_INTERPRET; used by tests/kernels/test_logits_loss_node.py)."""
import json
import sys

from compile_check import compile_launch, reduction_layouts


def main(path: str):
    for launch in json.loads(open(path).read()):
        layouts = reduction_layouts(compile_launch(launch).asm["ttgir"])
        print(json.dumps(dict(kernel=launch["kernel"], **layouts)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
