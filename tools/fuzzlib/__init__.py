"""The fuzz campaign behind ``tools/fuzz_campaign.py`` (see tools/README.md).

* `engine`: cases, targets, the outcome of one call, the worker loop.
* `inputs`: pools of malformed values, array mutations, damaged files.
* `valid`: valid windows and plans the targets start from; `checks`: independent checks of
  what the targets return; `files`: the cases of the targets that load files.
* ``t_*``: the targets, one module per part of the public API (they import the modules above,
  never one another's helpers, so the package has no import circle).
"""
