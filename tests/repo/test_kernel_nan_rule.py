"""Every min / max in erpo_kernels' Triton code propagates NaN as the torch reference does, or says why it need not.

Compiled Triton's tl.minimum / tl.maximum default to propagate_nan=NONE: on the GPU they return the other operand
for a NaN, so a clamp turned a NaN log-ratio into its bound (a finite Policy-KL where the reference gives NaN). The
interpreter's numpy propagates NaN either way, so a CPU run never sees it; this rule does. A call passes when it
gives propagate_nan (as `triton_common.clamp` does: every clamp of a data value goes through it) or when a comment
`# drops NaN: <reason>` sits on one of its lines or on a comment line right above it. The reductions tl.max / tl.min
take no propagate_nan (they skip NaN, compiled and interpreted), so each of them needs the comment."""
import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ELEMENTWISE = {"minimum", "maximum", "clamp"}
REDUCTIONS = {"max", "min"}
MARK = "drops NaN:"


def unmarked_min_max(source: str) -> list[int]:
    """Line numbers of the tl.minimum / tl.maximum / tl.clamp calls without propagate_nan and the tl.max / tl.min
    calls, in `source`, that carry no `# drops NaN:` comment."""
    comments = {}  # line -> (comment text, whether the line holds nothing else)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = (token.string, not token.line[:token.start[1]].strip())
    unmarked = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"):
            continue
        name = node.func.attr
        if name in ELEMENTWISE and any(keyword.arg == "propagate_nan" for keyword in node.keywords):
            continue
        if name not in ELEMENTWISE | REDUCTIONS:
            continue
        lines = range(node.lineno, node.end_lineno + 1)
        above = comments.get(node.lineno - 1, ("", False))
        if not (any(MARK in comments.get(line, ("",))[0] for line in lines) or (above[1] and MARK in above[0])):
            unmarked.append(node.lineno)
    return unmarked


def test_every_min_and_max_in_the_kernels_propagates_nan_or_says_why_not():
    offenders = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "erpo_kernels").glob("*.py"))
                 for line in unmarked_min_max(path.read_text())]
    assert not offenders, ("a tl min/max that drops NaN on the GPU (compiled Triton's default): use "
                           f"triton_common.clamp, or add '# {MARK} <reason>': {offenders}")


def test_the_rule_flags_a_bare_clamp_and_accepts_the_two_ways_out():
    source = '''
x = tl.minimum(tl.maximum(x, low), high)
y = tl.maximum(y, 0.0, propagate_nan=tl.PropagateNan.ALL)
m = tl.max(z, axis=0)  # drops NaN: counted apart
# drops NaN: integer codes
code = tl.minimum(code,
                  other)
w = tl.max(w, axis=0)
v = tl.where(a, tl.clamp(v, 0.0, 1.0), 0.0)  # a comment that gives no reason
'''
    assert sorted(unmarked_min_max(source)) == [2, 2, 8, 9]
