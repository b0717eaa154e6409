"""Every ```python and ```bash block of README.md runs as written (as pydantic-core's
``tests/test_docstrings.py`` runs its examples).

* A python block is executed on its own, in a fresh namespace, in a temporary directory.
* A bash block runs with ``bash -euo pipefail`` in a temporary directory, with a
  ``routepack`` command on PATH that runs the package under test (this checkout's, not
  whatever an earlier ``pip install`` put on PATH).
* The convention for blocks that must not run here: their **first line** is the comment
  ``# readme-test: skip (why)``, e.g. ``# readme-test: skip (installs the package)``. It is
  visible to every reader of the README; the test reports each skipped block with its
  reason, and only installs and long runs may use it (the reason must say which).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest

import routepack as rp

README = Path(__file__).resolve().parent.parent / "README.md"
PYTHON_DIR = str(Path(rp.__file__).resolve().parent.parent)
SKIP = re.compile(r"#\s*readme-test:\s*skip\s*\((?P<why>[^)]+)\)\s*$")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


class Block(NamedTuple):
    lang: str
    line: int  # of the opening fence, 1-based
    body: str

    @property
    def skip_reason(self) -> str:
        first = self.body.lstrip("\n").splitlines()[0] if self.body.strip() else ""
        m = SKIP.match(first.strip())
        return m.group("why").strip() if m else ""


def blocks(text: str) -> List[Block]:
    out = []
    for m in FENCE.finditer(text):
        if m.group("lang") in ("python", "bash"):
            out.append(Block(m.group("lang"), text.count("\n", 0, m.start()) + 1, m.group("body")))
    return out


BLOCKS = blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_blocks_that_run():
    assert {b.lang for b in BLOCKS if not b.skip_reason} == {"python", "bash"}
    for b in BLOCKS:
        if b.skip_reason:  # only installs and long runs may be skipped
            assert re.search(r"install|minutes|long|suite", b.skip_reason), (b.line, b.skip_reason)


def test_the_block_parser():
    text = (
        "x\n```python\nprint(1)\n```\n```\nnot run\n```\n```bash\n# readme-test: skip (installs)\npip install .\n```\n"
    )
    got = blocks(text)
    assert [(b.lang, b.line, b.skip_reason) for b in got] == [("python", 2, ""), ("bash", 8, "installs")]


def _shim(tmp: Path) -> dict:
    """Environment whose ``routepack`` on PATH is this checkout's package."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "routepack"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m routepack "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.lang}@L{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if block.skip_reason:
        pytest.skip(f"README.md line {block.line}: {block.skip_reason}")
    work = tmp_path / "work"
    work.mkdir()
    if block.lang == "python":
        monkeypatch.chdir(work)
        code = compile(block.body, f"README.md:{block.line}", "exec")
        exec(code, {"__name__": "__readme__"})
    else:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.body],
            cwd=work,
            env=_shim(tmp_path),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, f"README.md line {block.line}:\n{proc.stdout}\n{proc.stderr}"
