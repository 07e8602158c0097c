"""What one fused-path loss call (`fused_linear_erpo_loss`, Triton backend) costs the host, phase by phase and per
chunk, with no kernel running: microseconds, aten launches, Triton launches and host reads (host-device syncs on a
GPU) of each phase, on a small lm_head cut into the chunks and groups of a real one.

    python -m bench.host_cost --path fused                      # N=16384, the plan of qwen2.5-7b in 1 GiB
    python -m bench.host_cost --path fused --like qwen2.5-32b --workspace-gib 4 --json out.json
    python -m bench.host_cost --path fused --epilogue           # the row pass in the logits GEMM's epilogue (erpo-epi)

The problem is bench.problem's (samples of --rows-per-sample rows, a quarter of them query rows, bf16) with a tiny
D and V, and a workspace budget chosen so that the chunks and groups are those that `--like`'s lm_head gets on a
GPU in `--workspace-gib` (for qwen2.5-7b in 1 GiB: chunks of 512 rows, d hidden and d weight per 2048 rows): the
chunk loop runs as often, the host plans the same layout. As in `bench.host_cost`, every Triton launch is stubbed
(it returns at once and is counted), the aten operators run for real on tiny CPU tensors (their CPU time stands in
for a CUDA launch's host time), and Triton's own launch path is not in the times. Launches and host reads are
counted by the tests' LaunchCounter (tests/support/launch_counts.py) in one call apart from the timed ones. With
--epilogue (fused_linear_loss.EPILOGUE_ROW_PASS, the contender erpo-epi) each logits GEMM is the Triton GEMM with the
forward row pass in its epilogue (a Triton launch, stubbed) instead of cuBLAS's (an aten one); the GEMMs are seen
where every logits GEMM of the loss goes through, `LogitsBuffer._write`, whichever forms it.

Phases are exclusive: a phase's time and counts leave out those of the phases called inside it ("chunk" leaves out
the group GEMMs a chunk closes, "op setup" the plan, the objective's setup and the chunks). What the GPU waits for:
on a GPU each host read blocks the host until the queue drains, so the host time after a read, until the next
kernel is queued, is GPU idle time (the validation's read, then the op setup and the chunk plan after the layout
read, less the first half chunk's logits GEMM queued before it); inside the chunk loop the GPU waits only when a
chunk's host time exceeds its kernels' time. The second table puts each read against the long kernels around it
(`ReadTimeline`): the host's microseconds from the read's return to the next GEMM queued, to the first chunk's
forward row kernel queued and to the chunk loop, and the GEMM work queued after the read's copy, which the GPU still
has to run when the read returns, in GFLOP at `--like`'s lm_head (a CPU cannot time the GPU; FLOPs it can count).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from .host_cost import StubbedTriton, use_interpreter, wrapped_attributes
from .provenance import provenance

REPO = Path(__file__).resolve().parents[1]
SMALL_HIDDEN, SMALL_VOCAB = 16, 32  # the small lm_head's D and V (kernels do not run: small is honest)
# Where the chunk loop's work is queued: a chunk's (from its logits GEMM to its dlogits), a group's d hidden and
# d weight GEMMs (those of the group the chunk closes), a chunk's forward row kernel, and a logits GEMM of some rows
# (`LogitsBuffer._write`, which every logits GEMM of the loss goes through: cuBLAS's, and with EPILOGUE_ROW_PASS the
# Triton GEMM with the row pass in its epilogue)
CHUNK_LOOP = "erpo_kernels.fused_linear_loss:ChunkPass.run"
GROUP_GEMMS = "erpo_kernels.fused_linear_loss:GradientGroups.close_group"
CHUNK_FORWARD = "erpo_kernels.fused_linear_loss:ChunkPass.forward"
LOGITS_GEMM = "erpo_kernels.fused_linear_loss:LogitsBuffer._write"
# (phase, "module:attribute[.attribute]") of the functions each call goes through, timed and counted exclusively
FUSED_PHASES = [
    ("validation", "erpo_kernels.fused_linear:start_loss_input_checks"),
    ("op setup", "erpo_kernels.fused_linear_loss:loss_gradients"),
    ("chunk plan", "erpo_kernels.fused_linear_loss:plan_chunks"),
    ("objective setup", "erpo_kernels.triton_chunk_objective:TritonChunkObjective.start"),
    ("chunk", CHUNK_LOOP),
    ("group GEMMs", GROUP_GEMMS),
    ("objective value", "erpo_kernels.fused_linear:objective_on_backend"),
]
ENTRY, BACKWARD = "entry", "autograd backward"
MEASURES = ("us", "aten", "triton", "reads")
# Where a host read is queued and made (the copy to host memory, then the wait for it: `validation.read_later`,
# imported by name into the modules that read)
READ_LATER_USERS = ("erpo_kernels.validation", "erpo_kernels.fused_linear_loss")


def launch_counter():
    """A new tests/support/launch_counts.LaunchCounter (the tests' own count), loaded from this repository."""
    spec = importlib.util.spec_from_file_location("launch_counts", REPO / "tests" / "support" / "launch_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LaunchCounter()


class PhaseMeter:
    """Exclusive time (us) and, when `counter` is set, aten launches, Triton launches and host reads per phase, and
    each phase's calls: `frame(phase)` opens a phase, nested frames' amounts left out of their parent's."""

    def __init__(self, counter=None):
        self.counter = counter
        self.totals = defaultdict(lambda: dict.fromkeys(MEASURES, 0.0))
        self.calls = defaultdict(int)
        self._stack = []

    def _now(self):
        names = self.counter.names if self.counter is not None else {}
        aten = sum(count for name, count in names.items() if name.startswith("aten."))
        triton = sum(count for name, count in names.items() if name.startswith("triton."))
        reads = self.counter.syncs if self.counter is not None else 0
        return {"us": time.perf_counter_ns() / 1e3, "aten": aten, "triton": triton, "reads": reads}

    @contextlib.contextmanager
    def frame(self, phase: str):
        start, inside = self._now(), dict.fromkeys(MEASURES, 0.0)
        self._stack.append(inside)
        try:
            yield
        finally:
            self._stack.pop()
            end = self._now()
            spent = {m: end[m] - start[m] for m in MEASURES}
            for m in MEASURES:
                self.totals[phase][m] += spent[m] - inside[m]
                if self._stack:
                    self._stack[-1][m] += spent[m]
            self.calls[phase] += 1


def _resolve(target: str):
    """(owner, attribute) of "module:attribute" or "module:Class.attribute"."""
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *outer, attribute = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    return owner, attribute


def metered(meter: PhaseMeter, phases=FUSED_PHASES):
    """Each phase's function wrapped in meter.frame(phase) within the block; restored on exit."""
    def wrap(phase, function):
        def metered_call(*args, **kwargs):
            with meter.frame(phase):
                return function(*args, **kwargs)
        return metered_call

    return wrapped_attributes([(phase, *_resolve(target)) for phase, target in phases], wrap)


class ReadTimeline:
    """One call's host reads against the long kernels queued around them. On a GPU a read returns once the work
    queued before its copy is done; the GPU then runs only what was queued after the copy (GEMMs that the read does
    not wait for) while the host works on, until the host queues more: what the read costs in idle GPU time is the
    host's time from the read's return to the next long kernel beyond what that queued work covers. Times are the
    host's (us since an arbitrary origin); `counter` (a LaunchCounter), when set, also gives the launches queued
    between each read's copy and its return."""

    def __init__(self, counter=None):
        self.counter = counter
        self.reads = []  # per read: {"copy", "return"} us and the launches counted at each
        self.gemms = []  # (us once queued, GEMMs x rows: the FLOPs over 2 D V)
        self.logits_rows = []  # rows of each logits GEMM, in call order
        self.loop_start = self.first_forward = None  # us: the chunk loop's start, the first chunk's forward row kernel

    def _stamp(self, into: dict, key: str) -> None:
        into[key] = time.perf_counter_ns() / 1e3
        into[f"{key} launches"] = self.counter.launches if self.counter is not None else 0

    def recording(self):
        """The block within which the call's reads, GEMMs and chunk loop are recorded."""
        def wrap(point, function):
            if point == "read":
                def read_later(value, *options, **named_options):  # validation.read_later's reuse too
                    reader, entry = function(value, *options, **named_options), {}
                    self._stamp(entry, "copy")
                    self.reads.append(entry)

                    def read():
                        value_read = reader()
                        self._stamp(entry, "return")
                        return value_read
                    return read
                return read_later
            if point in ("loop", "forward"):
                def run(*args, **kwargs):
                    if point == "loop" and self.loop_start is None:
                        self.loop_start = time.perf_counter_ns() / 1e3
                    out = function(*args, **kwargs)
                    if point == "forward" and self.first_forward is None:  # once queued
                        self.first_forward = time.perf_counter_ns() / 1e3
                    return out
                return run

            def gemms(*args, **kwargs):
                if point == "logits":  # LogitsBuffer._write(self, first, hidden_rows): one GEMM
                    row_gemms = args[2].shape[0]
                    self.logits_rows.append(row_gemms)
                else:  # GradientGroups.close_group(self): d hidden and d weight, those needed, of the open group's rows
                    group = args[0]
                    row_gemms = (group.rows.stop - group.rows.start) * (
                        (group.grad_hidden is not None) + (group.grad_weight is not None))
                out = function(*args, **kwargs)
                if row_gemms:
                    self.gemms.append((time.perf_counter_ns() / 1e3, row_gemms))
                return out
            return gemms

        targets = [("read", importlib.import_module(module), "read_later") for module in READ_LATER_USERS]
        targets += [(point, *_resolve(target)) for point, target in (("logits", LOGITS_GEMM), ("group", GROUP_GEMMS),
                                                                     ("loop", CHUNK_LOOP),
                                                                     ("forward", CHUNK_FORWARD))]
        return wrapped_attributes(targets, wrap)

    def summary(self, hidden: int, vocab: int) -> list:
        """Per read, in call order: host us from its return to the next GEMM queued, to the first chunk's forward row
        kernel queued (None when queued before the return) and to the chunk loop's start;
        GFLOP (at an lm_head [vocab, hidden]) of the GEMMs queued after its copy and before its return (the GPU runs
        them after the read) and of those queued after its copy and before the chunk loop; launches between its
        copy and its return (with a counter)."""
        def gflop(since: float, until: float) -> float:
            return sum(rows for at, rows in self.gemms if since < at < until) * 2 * hidden * vocab / 1e9

        rows = []
        for entry in self.reads:
            back = entry["return"]
            next_gemm = next((at for at, _ in self.gemms if at > back), None)
            loop = self.loop_start if self.loop_start is not None and self.loop_start > back else None
            forward = self.first_forward if self.first_forward is not None and self.first_forward > back else None
            rows.append({"us to next GEMM": None if next_gemm is None else next_gemm - back,
                         "us to first row kernel": None if forward is None else forward - back,
                         "us to chunk loop": None if loop is None else loop - back,
                         "GFLOP queued, not waited for": gflop(entry["copy"], back),
                         "GFLOP queued before chunk loop": None if loop is None else gflop(entry["copy"], loop),
                         "launches between copy and read": entry["return launches"] - entry["copy launches"]})
        return rows


def _one_call(prepared, meter: PhaseMeter, timeline: ReadTimeline) -> None:
    with timeline.recording():
        with meter.frame(ENTRY):
            loss = prepared.run()
        with meter.frame(BACKWARD):
            torch.autograd.grad(loss, prepared.inputs)


def matching_budget(num_rows: int, hidden: int, vocab: int, like_hidden: int, like_vocab: int,
                    workspace_bytes: int, dtype: torch.dtype, epilogue: bool = False):
    """(budget bytes, Workspace): the workspace_bytes whose plan for N rows of the small lm_head [vocab, hidden] on
    the CPU has the chunk and group rows that `plan_workspace` gives [like_vocab, like_hidden] on CUDA in
    workspace_bytes; with `epilogue`, both plans' logits rows hold a row of the epilogue's statistics
    (EPILOGUE_ROW_PASS)."""
    from erpo_kernels.fused_linear_loss import (
        ROW_KERNELS,
        gradient_row_bytes,
        logits_row_bytes,
        plan_workspace,
    )
    from erpo_kernels.triton_logits_gemm import stats_row_bytes
    kernels, cpu = ROW_KERNELS["triton"], torch.device("cpu")
    target = plan_workspace(num_rows, like_hidden, like_vocab, dtype, torch.device("cuda"), kernels,
                            workspace_bytes, False, epilogue)
    gradient_row = gradient_row_bytes(vocab, hidden, dtype, cpu)
    logits_row = logits_row_bytes(vocab, kernels, stats_row_bytes(vocab, dtype) if epilogue else 0)
    if target.separate_store:
        budget = target.chunk_rows * logits_row + target.group_rows * (vocab * dtype.itemsize + gradient_row)
    else:
        budget = target.chunk_rows * (logits_row + gradient_row)
    small = plan_workspace(num_rows, hidden, vocab, dtype, cpu, kernels, budget, False, epilogue)
    if small != target:
        raise SystemExit(f"no budget gives the small lm_head the plan {target} (it gets {small})")
    return budget, target


def measure_fused(num_rows: int, rows_per_sample: int, like: str, workspace_gib: float, reps: int,
                  warmup: int, host_layout: bool = False, epilogue: bool = False) -> dict:
    """Per phase (FUSED_PHASES, ENTRY, BACKWARD, "total"): calls per fwd+bwd, median host us per call, and aten
    launches, Triton launches and host reads per call; with the plan's chunks and groups and the rows of each logits
    GEMM. host_layout: the loss is given the rows' layout in host memory (a trainer's way); epilogue: its logits GEMMs
    are the Triton GEMM with the forward row pass in its epilogue (EPILOGUE_ROW_PASS, the contender erpo-epi)."""
    from .contenders import ERPO_OPTIONS, erpo_fused_with_workspace
    from .geometry import fused_constants
    from .problem import Shape, build_problem, parse_shape
    like_shape = parse_shape(like)
    dtype = torch.bfloat16
    budget, workspace = matching_budget(num_rows, SMALL_HIDDEN, SMALL_VOCAB, like_shape.hidden, like_shape.vocab,
                                        int(workspace_gib * 2**30), dtype, epilogue)
    problem = build_problem("fused", Shape(f"D={SMALL_HIDDEN},V={SMALL_VOCAB}", SMALL_HIDDEN, SMALL_VOCAB),
                            num_rows, rows_per_sample=rows_per_sample, query_frac=0.25, dtype=dtype,
                            device=torch.device("cpu"), seed=0, chunk_rows=num_rows,
                            clip_low=ERPO_OPTIONS["clip_low"], clip_high=ERPO_OPTIONS["clip_high"])
    # the rows' layout in host memory, as a trainer holds it (read here once, not per call)
    layout = torch.stack((problem.token_kind, problem.sample_index)).long().cpu() if host_layout else None
    prepared = erpo_fused_with_workspace(budget, layout)(problem)
    per_rep, reads_per_rep = defaultdict(list), []
    with StubbedTriton(), fused_constants(EPILOGUE_ROW_PASS=epilogue):
        for rep in range(warmup + reps):
            meter, timeline = PhaseMeter(), ReadTimeline()
            with metered(meter):
                _one_call(prepared, meter, timeline)
            if rep >= warmup:
                for phase, amounts in meter.totals.items():
                    per_rep[phase].append(amounts["us"])
                per_rep["total"].append(sum(amounts["us"] for amounts in meter.totals.values()))
                reads_per_rep.append(timeline.summary(like_shape.hidden, like_shape.vocab))
        counting = PhaseMeter(launch_counter())
        counted_reads = ReadTimeline(counting.counter)
        if layout is not None:
            counting.counter.host_memory(layout)  # on the CPU, else taken for a device tensor
        with counting.counter, metered(counting):
            _one_call(prepared, counting, counted_reads)
    phases = {}
    for phase in [ENTRY, *(name for name, _ in FUSED_PHASES), BACKWARD]:
        counts = counting.totals.get(phase, dict.fromkeys(MEASURES, 0))
        phases[phase] = {"calls": counting.calls[phase], "us": statistics.median(per_rep[phase]),
                         **{m: counts[m] for m in ("aten", "triton", "reads")}}
    phases["total"] = {"calls": 1, "us": statistics.median(per_rep["total"]),
                       **{m: sum(p[m] for p in phases.values()) for m in ("aten", "triton", "reads")}}
    reads = []
    for number, counted in enumerate(counted_reads.summary(like_shape.hidden, like_shape.vocab)):
        timed = [rep[number] for rep in reads_per_rep]
        reads.append({**counted, **{key: _median_or_none([row[key] for row in timed])
                                    for key in ("us to next GEMM", "us to first row kernel", "us to chunk loop")}})
    return {"phases": phases, "reads": reads, "chunks": counting.calls["chunk"],
            "groups": counting.calls["group GEMMs"], "chunk_rows": workspace.chunk_rows,
            "group_rows": workspace.group_rows, "budget_bytes": budget,
            "logits_gemm_rows": counted_reads.logits_rows}


def _median_or_none(values: list):
    """The median of `values`, None when any is None (the event did not follow the read)."""
    return None if any(value is None for value in values) else statistics.median(values)


def markdown_fused(result: dict) -> str:
    """One row per phase: calls, host us per call and each, launches and reads each; then the per-chunk line."""
    lines = ["| phase | calls per fwd+bwd | host us per call (median) | us each | aten launches each | "
             "Triton launches each | host reads each |", "|---|---|---|---|---|---|---|"]
    for phase, row in result["phases"].items():
        calls = row["calls"] or 1
        lines.append(f"| {phase} | {row['calls']} | {row['us']:.0f} | {row['us'] / calls:.1f} | "
                     f"{row['aten'] / calls:g} | {row['triton'] / calls:g} | {row['reads'] / calls:g} |")
    chunk, group = result["phases"]["chunk"], result["phases"]["group GEMMs"]
    chunks = max(result["chunks"], 1)
    lines += ["", f"Per chunk, its share of the group GEMMs included: "
                  f"{(chunk['us'] + group['us']) / chunks:.1f} us, "
                  f"{(chunk['aten'] + group['aten']) / chunks:g} aten + "
                  f"{(chunk['triton'] + group['triton']) / chunks:g} Triton launches, "
                  f"{(chunk['reads'] + group['reads']) / chunks:g} host reads "
                  f"({result['chunks']} chunks of at most {result['chunk_rows']} rows, {result['groups']} groups of at "
                  f"most {result['group_rows']}); {len(result['logits_gemm_rows'])} logits GEMMs of "
                  f"{sum(result['logits_gemm_rows'])} rows in all."]
    lines += ["", "| host read (call order) | host us from its return to the next GEMM queued | to the first chunk's "
                  "forward row kernel | to the chunk loop | GFLOP queued after its copy, not waited for | GFLOP "
                  "queued after its copy, before the chunk loop | launches between its copy and its return |",
              "|---|---|---|---|---|---|---|"]
    for number, read in enumerate(result["reads"], 1):
        cells = [_cell(read[key], "{:.0f}") for key in ("us to next GEMM", "us to first row kernel",
                                                         "us to chunk loop")]
        cells += [_cell(read[key], "{:.1f}") for key in ("GFLOP queued, not waited for",
                                                          "GFLOP queued before chunk loop")]
        lines.append(f"| {number} | {' | '.join(cells)} | {read['launches between copy and read']} |")
    return "\n".join(lines)


def _cell(value, form: str) -> str:
    return "-" if value is None else form.format(value)


def main(argv: list[str], command: list[str]):
    """`python -m bench.host_cost --path fused` (host_cost.main's) with the options `argv`, those past --path;
    `command`: the whole command's arguments, which the JSON records."""
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost --path fused",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384, help="token rows N")
    parser.add_argument("--rows-per-sample", type=int, default=1024)
    parser.add_argument("--like", default="qwen2.5-7b", help="the lm_head whose chunks and groups to reproduce "
                                                             "(bench.problem.parse_shape)")
    parser.add_argument("--workspace-gib", type=float, default=1.0, help="its workspace budget on the GPU (GiB)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-layout", action="store_true",
                        help="give the loss the rows' layout in host memory (host_layout=, as erpo's trainer does)")
    parser.add_argument("--epilogue", action="store_true",
                        help="the forward row pass in the logits GEMM's epilogue (fused_linear_loss.EPILOGUE_ROW_PASS, "
                             "the contender erpo-epi): each logits GEMM a Triton launch")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--commit", default=None, help="commit the JSON records (default: git rev-parse HEAD, if any)")
    args = parser.parse_args(argv)
    use_interpreter(parser)
    torch.set_num_threads(1)
    result = measure_fused(args.n, args.rows_per_sample, args.like, args.workspace_gib, args.reps, args.warmup,
                           args.host_layout, args.epilogue)
    print(f"fused path, N={args.n} (samples of {args.rows_per_sample} rows), D={SMALL_HIDDEN}, V={SMALL_VOCAB}, "
          f"{'the rows layout given in host memory (host_layout), ' if args.host_layout else ''}"
          f"{'the row pass in the logits GEMM epilogue (EPILOGUE_ROW_PASS), ' if args.epilogue else ''}"
          f"bf16, CPU, the chunks and groups of {args.like} in {args.workspace_gib:g} GiB "
          f"(workspace_bytes={result['budget_bytes']} here); {args.reps} calls (after {args.warmup}), "
          f"torch {torch.__version__}\n")
    print(markdown_fused(result))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"meta": provenance("bench.host_cost", command, args.commit),
                       "args": {**vars(args), "path": "fused"}, "results": {"erpo": result}}, file, indent=1)
