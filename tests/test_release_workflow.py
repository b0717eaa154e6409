"""The release workflow (.github/workflows/release.yml) ships what `pip install routepack`
needs without a Rust toolchain: stripped abi3 wheels, manylinux2014 x86_64 and aarch64 and
macOS x86_64 and arm64, plus the sdist, each checked by .ci/wheel_check before a tag publishes
them, and CI (.ci/run) runs the same check on the wheel it builds. The license the metadata
names is the LICENSE file the wheel carries."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


@pytest.fixture(scope="module")
def workflow():
    doc = yaml.safe_load(WORKFLOW.read_text())
    # YAML 1.1 reads the key `on` as True
    return doc, doc.get("on", doc.get(True))


def targets(job):
    return {(p["runner"], p["target"]) for p in job["strategy"]["matrix"]["platform"]}


def test_every_platform_gets_a_wheel(workflow):
    doc, _ = workflow
    jobs = doc["jobs"]
    assert {t for _, t in targets(jobs["linux"])} == {"x86_64", "aarch64"}
    assert {t for _, t in targets(jobs["macos"])} == {"x86_64", "aarch64"}
    for name in ("linux", "macos"):
        build = next(s for s in jobs[name]["steps"] if s.get("uses", "").startswith("PyO3/maturin-action"))
        assert {"--release", "--strip"} <= set(build["with"]["args"].split()), name
    build = next(s for s in jobs["linux"]["steps"] if s.get("uses", "").startswith("PyO3/maturin-action"))
    assert build["with"]["manylinux"] == "2014"
    check = " ".join(s.get("run", "") for s in jobs["linux"]["steps"])
    assert "WHEEL_MUST_BE_MANYLINUX=1" in check
    sdist = next(s for s in jobs["sdist"]["steps"] if s.get("uses", "").startswith("PyO3/maturin-action"))
    assert sdist["with"]["command"] == "sdist"


def test_every_artifact_is_checked_before_it_is_published(workflow):
    doc, on = workflow
    jobs = doc["jobs"]
    for name in ("linux", "macos", "sdist"):
        runs = " ".join(s.get("run", "") for s in jobs[name]["steps"])
        assert ".ci/wheel_check" in runs, name
    publish = jobs["publish"]
    assert set(publish["needs"]) == {"linux", "macos", "sdist"}
    assert publish["if"].strip("${} ").startswith("startsWith(github.ref, 'refs/tags/v')")
    assert on["push"]["tags"] == ["v*"]


def test_ci_checks_the_wheel():
    run = (ROOT / ".ci" / "run").read_text()
    assert ".ci/wheel_check" in run
    check = (ROOT / ".ci" / "wheel_check").read_text()
    for what in ("maturin build --release --strip", "-m venv", "--only-binary=:all:", "routepack demo", "env -i"):
        assert what in check, what
    for what in ("*-abi3-*", "WHEEL_MUST_BE_MANYLINUX", ".symtab", "LICENSE", "License-Expression"):
        assert what in check, what


def test_the_license_the_metadata_names_is_in_the_tree():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert cargo["workspace"]["package"]["license"] == "Apache-2.0"
