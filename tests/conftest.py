"""Hypothesis profiles. ``ci`` (`.ci/run` passes ``--hypothesis-profile=ci``) draws the same
cases on every run, from each test's own name, and neither reads nor writes the example
database, so a landing is decided by the change and not by the draw or by examples a
developer's earlier runs saved. Developers' runs use hypothesis's default: fresh draws, and
the failures they found replayed first."""

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
