"""The fuzz campaign behind ``tools/fuzz_campaign.py`` (see tools/README.md).

* `engine`: cases, targets, the outcome of one call, the worker loop.
* `inputs`: pools of malformed values, array mutations, damaged files.
* ``t_*``: the targets, one module per part of the public API.
"""
