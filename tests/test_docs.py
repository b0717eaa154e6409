"""The documentation says what the code and the tree hold:

* README.md is a user's page of at most `README_MAX_LINES` lines, and `.ci/run` runs its test
  command verbatim;
* every relative link of README.md, CHANGELOG.md and docs/ resolves, anchors included;
* the file trees in README.md and docs/design.md name files and folders that exist;
* every results page under docs/results, and docs/bench_scale.md, is what `routepack.results`
  renders from the committed JSON (its header holds the command);
* docs/design.md counts the AVX2 functions the core has.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Dict, List, Set

import pytest

from routepack import results

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}


def tracked() -> List[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: Dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> List[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


def test_the_slug_is_githubs():
    assert slug("The cost model (what `simulate` computes)") == "the-cost-model-what-simulate-computes"
    assert slug("Calibration (`routepack calibrate`)") == "calibration-routepack-calibrate"


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_relative_link_resolves(path: Path):
    assert path.is_file(), path
    bad = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert bad == [], f"{path.relative_to(ROOT)}: {bad}"


def test_the_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    text = "\n".join(lines)
    # no lab notebook: no clock times, load averages or dated runs
    assert not re.search(r"\b\d\d:\d\d\b|load average|\b2026-\d\d-\d\d\b", text), re.search(
        r"\b\d\d:\d\d\b|load average|\b2026-\d\d-\d\d\b", text
    )
    assert "prediction of" in text and "not a" in text  # the bench figures say what they are


def _readme_test_command() -> str:
    """The README's test command: the one command line of its bash block that installs the test
    extras and runs pytest."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [m.group("body") for m in FENCE.finditer(text) if m.group("lang") == "bash"]
    found = [b for b in blocks if "pytest" in b and "pip install" in b]
    assert len(found) == 1, "README.md needs one bash block that installs the test extras and runs pytest"
    body = [ln for ln in found[0].splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(body) == 1, f"README.md's test command is one line, not {body}"
    return body[0]


def test_ci_runs_the_readmes_test_command_verbatim():
    """.ci/run runs the README's test command as written there (a line of its own, not a
    spelling of it), so the two cannot drift; it exports CI so that tests needing a framework
    CI installs fail instead of skipping (tests/conftest.py)."""
    command = _readme_test_command()
    assert command.startswith("pip install -e ") and command.endswith(" && python -m pytest"), command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f".ci/run does not run {command!r} as a line of its own"
    assert "export CI=${CI:-1}" in ci
    ran = [ln for ln in ci if ln and not ln.startswith("#")]
    # nothing after it installs what the tests import, or runs pytest a second time
    after = ran[ran.index(command) + 1 :]
    assert not [ln for ln in after if "pytest" in ln or ("pip install" in ln and "wheel" not in ln)], after


def _tree_blocks(path: Path) -> List[str]:
    text = path.read_text(encoding="utf-8")
    bodies = [m.group("body") for m in FENCE.finditer(text) if m.group("lang") in ("", "text")]
    return [b for b in bodies if b.startswith("crates/routepack-core/src/")]


@pytest.mark.parametrize("name", ["README.md", "docs/design.md"])
def test_file_trees_name_what_exists(name: str):
    files = tracked()
    basenames = {Path(f).name for f in files}
    folders = {part for f in files for part in Path(f).parts[:-1]}
    bad = []
    for block in _tree_blocks(ROOT / name):
        for token in re.findall(r"[\w./-]+", block):
            last = token.rstrip("/").split("/")[-1]
            if not last or last.startswith("."):  # "uint8 / uint16", "py_<stage>.rs"
                continue
            if token.endswith((".rs", ".py", ".md")) and last not in basenames:
                bad.append(token)
            elif token.endswith("/") and last not in folders:
                bad.append(token)
    assert bad == [], f"{name} names {bad}, which are not in the tree"


def test_the_results_pages_are_rendered_from_their_json(monkeypatch):
    pages = sorted(p for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "README.md")
    pages.append(ROOT / "docs" / "bench_scale.md")  # written by benches/scale.py --page
    assert pages, "docs/results holds no page"
    monkeypatch.chdir(ROOT)
    for page in pages:
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        assert lines[0].startswith("<!-- generated"), f"{page.name}: not a generated page"
        argv = shlex.split(lines[1])
        assert argv[:3] == ["python", "-m", "routepack.results"], lines[1]
        args = results.parser().parse_args(argv[3:])
        assert Path(args.out).resolve() == page.resolve(), (page, args.out)
        again = results.render(args.kind, args.json, Path(args.out), args.figure, args.note, args.command)
        assert again == text, f"{page.relative_to(ROOT)} is stale: run `{lines[1]}`"


def test_design_counts_the_avx2_functions():
    src = ROOT / "crates" / "routepack-core" / "src"
    attr = '#[target_feature(enable = "avx2")]'
    count = sum(ln.strip().startswith(attr) for f in src.rglob("*.rs") for ln in f.read_text().splitlines())
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    m = re.search(r"(\w+) functions have AVX2 builds", text)
    assert m, "docs/design.md no longer says how many functions have AVX2 builds"
    said = NUMBERS.get(m.group(1).lower(), None) or int(m.group(1))
    assert said == count, f"docs/design.md says {m.group(1)}, the core has {count}"


def test_design_knows_the_lower_bound():
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    assert "no lower bound on the step time" not in text and "lower_bound_time" in text
