"""Compile for sm_90 each Triton launch a JSON file lists (`compile_check.launch_specializations`, argv[1]), as the
launcher would compile it, and print one JSON line per launch: its kernel, `compile_check.reduction_layouts` and
the layout conversions in each of its loops (`compile_check.loop_layout_conversions`) (run without TRITON_INTERPRET;
used by tests/kernels/test_logits_loss_node.py)."""
import json
import sys

from compile_check import compile_launch, loop_layout_conversions, reduction_layouts


def main(path: str):
    for launch in json.loads(open(path).read()):
        ttgir = compile_launch(launch).asm["ttgir"]
        print(json.dumps(dict(kernel=launch["kernel"], **reduction_layouts(ttgir),
                              loop_conversions=loop_layout_conversions(ttgir))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
