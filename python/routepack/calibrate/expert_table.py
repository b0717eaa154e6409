"""The expert table's knots and columns (`CostModel.expert_table`, fitted by
`routepack.calibrate.fit.fit_expert_gemm`): where the knots go among a sweep's tokens per
expert, and each knot's piecewise-linear hat, so that a table's value at any count is the hats
times the knots' seconds, as the core's `CostModel::table_extra` interpolates it.
"""

from __future__ import annotations

import numpy as np


#: Knots of the table: tokens per expert 1, 2 (the GEMM step), then every power of TABLE_RATIO
#: and the sweep's largest count (where the fit holds the table at 0, so c_tok is the slope
#: there); the swept counts between knots are interpolated, so a held-out point there tests the
#: curve's form.
TABLE_RATIO = 4


def table_knots(per: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    """float ``[knots]``: the table's knots (`TABLE_RATIO`) among the swept tokens per expert
    ``per`` ``[n]`` that a fitted point (``fitted`` bool ``[n]``) measures, increasing."""
    top = float(per.max()) if per.size else 1.0
    powers = 1 + int(np.log(max(top, 1.0)) / np.log(TABLE_RATIO))
    grid = {1.0, 2.0, top} | {float(TABLE_RATIO**j) for j in range(powers)}
    have = set(per[fitted].tolist())
    return np.array(sorted(k for k in grid if k in have and k <= top))


def table_columns(per: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """float ``[n, knots]``: each knot's piecewise-linear hat at ``per`` (1 at its knot, 0 at
    its neighbours; the end knots' constant outside them), so a table's value at ``per`` is
    ``columns @ seconds``, as `CostModel.table_extra` interpolates it."""
    eye = np.eye(len(knots))
    return np.stack([np.interp(per, knots, eye[k]) for k in range(len(knots))], axis=1)
