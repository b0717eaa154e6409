"""Hypothesis profiles, and what a test may skip for in CI.

Hypothesis: ``ci`` (`.ci/run` passes ``--hypothesis-profile=ci``) draws the same cases on
every run, from each test's own name, and neither reads nor writes the example database, so a
landing is decided by the change and not by the draw or by examples a developer's earlier runs
saved. Developers' runs use hypothesis's default: fresh draws, and the failures they found
replayed first.

Optional frameworks: on a machine that ran only the README's test command
(``pip install -e ".[test,torch,hf]"``), a test that needs a framework the extras do not install
(megatron-core, verl, ray, ...) skips and names it. In CI (``CI`` set, as CI services and
`.ci/run` set it) every module of `CI_REQUIRES` must import: a missing one stops the run before
any test, and a test that skips because one of them could not be imported fails instead, so a
broken install cannot pass as a row of skips.
"""

from __future__ import annotations

import importlib
import os
import re

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)

#: What CI installs for the tests (the README's extras and .ci/run's framework step): each must
#: import in CI. slime is not on PyPI, so its real-code tests skip everywhere it is not installed.
CI_REQUIRES = (
    "torch",
    "transformers",
    "scipy",
    "matplotlib",
    "yaml",
    "megatron.core",
    "megatron.core.pipeline_parallel.schedules",
    "verl",
    "verl.utils.seqlen_balancing",
    "verl.trainer.ppo.ray_trainer",
    "transfer_queue",
    "verl.trainer.ppo.v1.trainer_base",
    "tensordict",
    "torchdata",
    "ray",
    "omegaconf",
    "psutil",
    "routepack.integrations.hf",
    "routepack.torch.window_gather",
)
_COULD_NOT_IMPORT = re.compile(r"could not import '([\w.]+)'")


def in_ci() -> bool:
    """Whether this run is CI's (``CI`` set to anything but empty, 0, false or no)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not in_ci():
        return
    missing = []
    for name in CI_REQUIRES:
        try:
            importlib.import_module(name)
        except Exception as e:  # an install that imports only partly counts as missing
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise pytest.UsageError("CI requires these modules, which do not import: " + "; ".join(missing))


def _required_skip(report) -> str:
    """The CI-required module a skipped report could not import ("" if none)."""
    if not (report.skipped and isinstance(report.longrepr, tuple)):
        return ""
    m = _COULD_NOT_IMPORT.search(str(report.longrepr[2]))
    if m is None:
        return ""
    name = m.group(1)
    return name if any(name == r or name.startswith(r + ".") or r.startswith(name + ".") for r in CI_REQUIRES) else ""


def _fail_in_ci(report) -> None:
    name = _required_skip(report) if in_ci() else ""
    if name:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which requires {name}: {report.longrepr[2]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_in_ci(outcome.get_result())
