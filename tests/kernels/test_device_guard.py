"""CPU CI's guard for the GPU: a kernel-tier test that builds its tensors on the CPU passes here, where Triton's
interpreter runs on CPU tensors, and fails on a GPU, where the compiled kernels refuse them (23 tests did on the first
H100 run, issue 31). So every tensor a kernel-tier test file creates names its device: each torch factory call passes
`device=` (the `device` fixture's, or "cpu" on purpose), or is moved to a device at once (`.to(device, ...)`) or
later through the name it is assigned to (`x = torch.randn(..., generator=g)`, then `x.to(device)` in that file), and
each call of a test helper that takes a `device` argument passes one. (Not checked: modules, which a test moves with
`.to(device)`; helpers are known by name, so two helpers of one name in different files count as one.)"""
import ast
from pathlib import Path

KERNEL_TIER = Path(__file__).resolve().parent
# torch functions that create a tensor on the default device (the CPU) unless told otherwise; *_like and ops on
# existing tensors inherit their input's device
FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace",
                       "eye", "rand", "randn", "randint", "randperm", "normal", "empty_strided", "tril_indices",
                       "triu_indices"})
MOVES = frozenset({"to", "cuda"})


def _is_a_device(node: ast.expr) -> bool:
    """`device`, `x.device`, a device string, or `torch.device(...)`."""
    return ((isinstance(node, ast.Name) and node.id == "device") or (isinstance(node, ast.Attribute)
            and node.attr == "device") or (isinstance(node, ast.Constant) and node.value in ("cpu", "cuda", "meta"))
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device"))


def _names_a_device(call: ast.Call) -> bool:
    """`call` passes a device: `device=...`, `**kwargs` (cannot tell) or a positional device; `.cuda()` needs none."""
    if isinstance(call.func, ast.Attribute) and call.func.attr == "cuda":
        return True
    return any(k.arg in ("device", None) for k in call.keywords) or any(map(_is_a_device, call.args))


def _assigns_to(target: ast.expr, names: set) -> bool:
    """`target` is one of `names` or an element of one (`x[...]`)."""
    if isinstance(target, ast.Subscript):
        target = target.value
    return isinstance(target, ast.Name) and target.id in names


def _takes_device(function: ast.FunctionDef) -> bool:
    arguments = function.args
    return any(a.arg == "device" for a in arguments.args + arguments.kwonlyargs + arguments.posonlyargs)


def device_helpers(sources: list) -> set:
    """Names of the functions defined in `sources` (python source texts) that take a `device` argument, tests (which
    get the fixture) excepted."""
    return {node.name for source in sources for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and _takes_device(node) and not node.name.startswith("test_")}


def device_problems(source: str, filename: str, helpers: set) -> list:
    """'file:line: what' for each call in `source` that creates a tensor without naming its device."""
    tree = ast.parse(source)
    moved = set()   # calls inside what is then moved to a device: (torch.randn(...) * 2).to(device, dtype)
    moved_names = set()  # names the file moves: x.to(device)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MOVES
                and _names_a_device(node)):
            moved.update(id(inner) for inner in ast.walk(node.func.value) if isinstance(inner, ast.Call))
            if isinstance(node.func.value, ast.Name):
                moved_names.add(node.func.value.id)
    for node in ast.walk(tree):  # x = torch.randn(...) or x[torch.randint(...)] = ..., x moved later
        if isinstance(node, ast.Assign) and any(_assigns_to(target, moved_names) for target in node.targets):
            moved.update(id(inner) for inner in ast.walk(node) if isinstance(inner, ast.Call))
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in moved or _names_a_device(node):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in FACTORIES and isinstance(func.value, ast.Name)
                and func.value.id == "torch"):
            problems.append((node.lineno, f"torch.{func.attr}(...)"))
        elif isinstance(func, ast.Name) and func.id in helpers:
            problems.append((node.lineno, f"{func.id}(...)"))
    return [f"{filename}:{line}: {what} without device=" for line, what in sorted(problems)]


def _support_sources() -> list:
    """The kernel tier's own files and the shared test helpers (tests/support)."""
    return [p.read_text() for p in list(KERNEL_TIER.glob("*.py")) + list((KERNEL_TIER.parent / "support").glob("*.py"))]


def test_every_kernel_test_names_the_device_of_its_tensors():
    files = sorted(p for p in KERNEL_TIER.glob("test_*.py"))
    assert {"test_triton_logits.py", "test_fused_linear.py", "test_compile.py"} <= {p.name for p in files}
    helpers = device_helpers(_support_sources())
    assert "random_batch" in helpers
    problems = [problem for p in files for problem in device_problems(p.read_text(), p.name, helpers)]
    assert not problems, ("kernel-tier tests creating tensors on the default device (the CPU), which the GPU's "
                          "Triton kernels refuse; take the `device` fixture:\n" + "\n".join(problems))


GOOD = '''
def make(n, *, device):
    return torch.randn(n).to(device, torch.float32)

def test_ok(device):
    x = torch.zeros(3, device=device)
    y = torch.randint(0, 5, (3,), generator=g).to(device)
    z = make(3, device=device) + torch.ones(3, dtype=torch.long, device=x.device) + torch.zeros_like(x)
    w = torch.tensor([1.0], device="cpu")  # on the CPU on purpose
    v = (torch.randn(3, generator=g) * 2.0).to(device, torch.bfloat16) + make(3, torch.device("cpu"))
    u = torch.rand(2, generator=g) < 0.5
    u[torch.randint(0, 2, (1,), generator=g)] = True
    return torch.full((2,), 1.0).cuda(), torch.arange(4, **options), make(4, device), u.to(device)
'''
BAD = '''
ROWS = torch.tensor([0, 1, 2])

def test_bad(device):
    x = torch.randn(3).to(torch.bfloat16)
    y = make(3)
    z = torch.ones(2)
    return x, y, torch.arange(3).to(device), z.to(torch.float64)
'''


def test_the_guard_flags_tensors_without_a_device_and_accepts_every_way_of_naming_one():
    helpers = device_helpers([GOOD])
    assert helpers == {"make"}
    assert device_problems(GOOD, "good.py", helpers) == []
    assert device_problems(BAD, "bad.py", helpers) == [
        "bad.py:2: torch.tensor(...) without device=", "bad.py:5: torch.randn(...) without device=",
        "bad.py:6: make(...) without device=", "bad.py:7: torch.ones(...) without device="]
