"""One optimizer step of `erpo train` on 2 ranks (gloo), launched by tests/distributed/test_step_split_ranks.py through
torchrun: each rank runs tests/support/step_split.py's step on its share of the rollout (RANK_SHARES: 4 samples
and 2, so rank 1 pads with stand-ins), its gradients are averaged over the ranks as DeepSpeed averages them, and
rank 0 writes {case/micro-batch size: (gradient, metrics record)} to --out, and under "deepspeed-zero2" the
gradient norm erpo's DeepSpeedUpdater reports for one case at ZeRO-2."""
import argparse

from erpo import distributed as D
from step_split import CASES, GROUP_2_FILTERED, RANK_SHARES, deepspeed_grad_norm, rollout, step_gradient
from torchrun import finish_worker


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    D.init_distributed("gloo")
    start, stop = RANK_SHARES[D.rank()]
    runs = {(case, micro): (overrides, rollout()) for case, overrides in CASES.items() for micro in (1, 3)}
    runs[("group-2-filtered", 1)] = ([], rollout(keep=GROUP_2_FILTERED))
    result = {}
    for (case, micro), (overrides, samples) in runs.items():
        grad, record = step_gradient(overrides, micro, samples.select(start, stop))
        result[f"{case}/{micro}"] = (D.all_reduce_sum(grad) / D.world_size(), record)
    # the same step through DeepSpeed's own accumulation and reduction (ZeRO-2), micro-batches of 1
    result["deepspeed-zero2"] = deepspeed_grad_norm(CASES["seq-mean-token-sum"], 1, rollout().select(start, stop), 2)
    finish_worker(result, args.out)


if __name__ == "__main__":
    main()
