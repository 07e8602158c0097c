"""The documentation stands alone: every relative link in README.md and docs/ resolves inside the repository, and
every test it cites exists."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


# erpo's tests live in a tier's folder (docs/CONTRIBUTING.md); a bare tests/test_x.py is a peer's (TRL's own suite)
TEST_REFERENCE = re.compile(r"\b(tests/(?:kernels|train|integrations|distributed|repo|support|workers)/[\w/]+\.py)"
                            r"(?:::(\w+))?")


def missing_test_references(text: str) -> list[str]:
    """The `tests/TIER/file.py` and `tests/TIER/file.py::name` references in `text` whose file, or whose test
    function or class in it, does not exist."""
    missing = []
    for reference in TEST_REFERENCE.finditer(text):
        file, name = REPO / reference[1], reference[2]
        if not file.is_file():
            missing.append(reference[0])
        elif name and not re.search(rf"^(def|class) {name}\b", file.read_text(), re.MULTILINE):
            missing.append(reference[0])
    return missing


def heading_anchors(text: str) -> set[str]:
    """The `#anchor`s GitHub gives the headings of a markdown text: lowercased, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated one suffixed `-1`, `-2`, ...; code blocks' `#` lines are no headings."""
    anchors, seen, in_code = set(), {}, False
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        heading = None if in_code else re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading[1].strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_are_github_s():
    text = "# Top\n## TRL: two changed lines\n```bash\n# not a heading\n```\n### Options (`+erpo.NAME=VALUE`)\n## Top\n"
    assert heading_anchors(text) == {"top", "trl-two-changed-lines", "options-erponamevalue", "top-1"}


def test_relative_links_resolve_inside_the_repository():
    """Each relative link's file exists, and its `#anchor`, in a markdown file, is one of that file's headings."""
    files = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for file in files:
        text = file.read_text()
        assert "../shared" not in text, f"{file.name} points outside the repository"
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            path = (file.parent / name).resolve() if name else file
            assert path.is_relative_to(REPO) and path.exists(), f"{file.name}: broken link {target}"
            if anchor and path.suffix == ".md":
                assert anchor in heading_anchors(path.read_text()), f"{file.name}: no heading for {target}"


def test_method_summary_holds_the_equations_and_the_paper_reference():
    text = (REPO / "docs" / "method.md").read_text()
    for needle in ("ell_theta0(q) - ell_theta(q)", "k3(r) = exp(r) - r - 1", "w(q) = clip(mean(s) / s_q, 0, 2)",
                   "Beyond the Stability-Exploration Dilemma", "arXiv"):
        assert needle in text


def test_every_row_of_the_fault_table_names_tests_that_exist():
    """docs/distributed.md's "What survives what": each fault names the tests that prove it, and they exist."""
    section = (REPO / "docs" / "distributed.md").read_text().split("### What survives what")[1]
    table = section.split("\n| ", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]     # the header and |---| lines go
    assert len(rows) >= 6
    for row in rows:
        tests = row.rsplit("|", 2)[1]
        assert re.search(r"`tests/[\w/]+\.py::\w+`", tests), row
        assert missing_test_references(tests) == [], row



def test_the_tests_the_docs_name_exist():
    """A doc that cites a test as the proof of a claim names one that exists (a renamed or deleted test leaves the
    claim unproven). CHANGELOG.md is history: it names files as they were then."""
    assert missing_test_references("tests/train/test_resume.py::test_sigterm_saves_and_resume_matches "
                                   "tests/train/test_evaluation.py") == []
    assert missing_test_references("tests/train/test_resume.py::test_no_such_test tests/train/test_nothing.py") == [
        "tests/train/test_resume.py::test_no_such_test", "tests/train/test_nothing.py"]
    files = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = {file.name: found for file in files if (found := missing_test_references(file.read_text()))}
    assert not missing, f"docs name tests that do not exist: {missing}"
