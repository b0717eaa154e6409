"""Cases shared by the targets that load files (`Window.load`, `Plan.load`): a saved object
read back, damaged copies of its file, and a file of the other type."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import routepack as rp

from fuzzlib.checks import check_window
from fuzzlib.engine import Case
from fuzzlib.inputs import damage
from fuzzlib.t_model import tmp_path
from fuzzlib.valid import consistent_window, valid_plan


def file_load_case(cls: Any, make: Any, what: str):
    def gen(rng: np.random.Generator) -> Case:
        obj = make(rng)
        buf = io.BytesIO()
        obj.save(buf)
        raw = buf.getvalue()
        path = tmp_path(what)
        if rng.random() < 0.2:
            Path(path).write_bytes(raw)
            return Case("valid", cls.load, (path,), check=lambda back: check_same(back, obj), expect="ok")
        label, bad, forged = damage(rng, raw)

        def setup() -> Any:
            Path(path).write_bytes(bad)
            return (path,), {}

        def check(back: Any) -> None:
            # a harmless flip (a timestamp) may load; it must then give the saved data; a
            # member forged with well-formed contents may be valid data of its own
            assert isinstance(back, cls), f"returned {type(back).__name__}"
            if isinstance(back, rp.Window):
                check_window(back, None, None)
            assert forged or same_data(back, obj), f"damaged file ({label}) loaded as different data"

        return Case("damaged", cls.load, (path,), check=check, note=label, names=(path, repr(path)), setup=setup)

    return gen


def same_data(a: Any, b: Any) -> bool:
    if isinstance(b, rp.Plan):
        return isinstance(a, rp.Plan) and a.same_as(b) and a.report == b.report and a.policy == b.policy
    return a == b


def check_same(a: Any, b: Any) -> None:
    assert same_data(a, b), "load(save(x)) differs from x"


def other_type_case(rng: np.random.Generator) -> Case:
    """A plan file given to Window.load, or a window file to Plan.load."""
    path = tmp_path("swap")
    plan_case = valid_plan(rng)
    w = consistent_window(rng)
    if rng.random() < 0.5:
        plan_case.plan.save(path)
        return Case("damaged", rp.Window.load, (path,), note="a Plan file", names=(path,), expect="error")
    w.save(path)
    return Case("damaged", rp.Plan.load, (path,), note="a Window file", names=(path,), expect="error")
