"""Input errors blame the argument that is wrong, and tensors an option leaves unused are still checked; the Triton
interpreter runs without a warning the user cannot act on, and TRITON_INTERPRET set too late is one line saying
what to do (both run as a user runs them: a fresh interpreter)."""
import os
import subprocess
import sys

import pytest
import torch

from erpo_kernels import erpo_loss, fused_linear_erpo_loss
from interpreter_as_gpu import NUMPY_SCALAR_ERROR
from paths import worker_pythonpath

N, V, D = 6, 11, 8


def loss_on(path: str, device, shapes: dict, **options):
    """The loss on two samples (S = 2) with tensors of the given shapes (name -> shape); query_weight >= 0."""
    kind = torch.tensor([1, 2, 2, 1, 2, 2], device=device)
    sample = torch.tensor([0, 0, 0, 1, 1, 1], device=device)
    targets = torch.randint(0, V, (N,), device=device)
    inputs = {name: (torch.rand if name == "query_weight" else torch.randn)(shape, device=device)
              for name, shape in shapes.items()}
    if path == "logits":
        return erpo_loss(torch.randn(N, V, device=device), targets, kind, sample, backend="torch", **inputs,
                         **options)
    return fused_linear_erpo_loss(torch.randn(N, D, device=device), torch.randn(V, D, device=device), targets, kind,
                                  sample, backend="torch", **inputs, **options)


@pytest.mark.parametrize("path", ["logits", "fused"])
@pytest.mark.parametrize("shapes, options, message", [
    # advantages of the wrong length: the one blamed, not ref_query_logp (the rows name 2 samples)
    ({"advantages": 3, "ref_query_logp": 2}, {},
     r"^advantages must have length 2 \(S, the length of ref_query_logp, and the samples sample_index names on "
     r"scored rows\), got shape \(3,\)$"),
    ({"advantages": 3, "ref_query_logp": 2, "query_weight": 2}, {},
     r"^advantages must have length 2 \(S, the length of ref_query_logp and query_weight\), got shape \(3,\)$"),
    ({"advantages": 2, "ref_query_logp": 3}, {},
     r"^ref_query_logp must have length 2 \(S, the length of advantages, and the samples sample_index names"),
    ({"advantages": 2, "ref_query_logp": 2, "query_weight": 1}, {},
     r"^query_weight must have length 2 \(S, the length of advantages and ref_query_logp\), got shape \(1,\)$"),
    # unused by the options, still checked: qkl_coef=0 leaves ref_query_logp unused, policy_kl_coef=0 ref_logp
    ({"advantages": 2, "ref_query_logp": 3}, {"qkl_coef": 0.0}, r"^ref_query_logp must"),
    ({"advantages": 3, "ref_query_logp": 2}, {"qkl_coef": 0.0}, r"^advantages must"),
    ({"advantages": 2, "ref_query_logp": 2, "ref_logp": N + 1}, {},
     r"^ref_logp must have length 6 \(the number of rows N\), got shape \(7,\)$"),
    ({"advantages": 2, "ref_query_logp": 2, "ref_logp": (N, 1)}, {},
     r"^ref_logp must have 1 dimension\(s\), got shape \(6, 1\)$"),
])
def test_a_length_error_blames_the_wrong_argument(path, shapes, options, message, device):
    with pytest.raises(ValueError, match=message):
        loss_on(path, device, shapes, **options)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment.update(env, PYTHONPATH=worker_pythonpath())  # this checkout, interpreter patched as the suite's
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=environment)


def test_triton_interpret_set_after_the_import_is_one_line_saying_what_to_do():
    result = run_python("import os, torch, erpo_kernels\n"
                        "os.environ['TRITON_INTERPRET'] = '1'\n"
                        "try:\n"
                        "    erpo_kernels.token_logprobs(torch.randn(3, 5), torch.tensor([1, 2, 3]),\n"
                        "                                backend='triton')\n"
                        "except RuntimeError as exc:\n"
                        "    print(exc)\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "TRITON_INTERPRET=1 was set after erpo_kernels was imported, too late for its kernels (Triton reads it when "
        "they are defined): set it before anything imports erpo_kernels or triton (TRITON_INTERPRET=1 python ...), "
        "or use backend='torch'"]


@pytest.mark.cpu_only
def test_the_interpreter_runs_the_kernels_without_a_runtime_warning():
    # the forward's masked columns computed 0 * -inf (a NaN then discarded) and numpy warned on every call; every
    # kernel looped over range() of a run-time bound, which numpy 2.5 refuses (interpreter_as_gpu.py): an error here
    code = """
import warnings
warnings.simplefilter("error", RuntimeWarning)
import torch
from erpo_kernels import erpo_loss, fused_linear_erpo_loss, token_logprobs
targets = torch.randint(0, 11, (6,))
kind, sample = torch.tensor([1, 2, 2, 1, 2, 0]), torch.tensor([0, 0, 0, 1, 1, 1])
for options in ({}, {"logit_softcap": 3.0}, {"qkl_estimator": "k3-token", "ref_logp": torch.randn(6)},
                {"top_entropy_quantile": 0.5}):
    logits = torch.randn(6, 11, requires_grad=True)
    erpo_loss(logits, targets, kind, sample, advantages=torch.randn(2), ref_query_logp=torch.randn(2),
              backend="triton", **options).loss.backward()
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    fused_linear_erpo_loss(hidden, weight, targets, kind, sample, advantages=torch.randn(2),
                           ref_query_logp=torch.randn(2), backend="triton", **options).loss.backward()
token_logprobs(torch.randn(6, 11), torch.tensor([1, 2, -100, 3, 4, 5]), backend="triton", return_entropy=True)
print("ok")
"""
    result = run_python(code, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS=NUMPY_SCALAR_ERROR)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    assert "Warning" not in result.stderr, result.stderr[-3000:]
