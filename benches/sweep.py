"""Stage-combination sweep (issue 14): is the `routepack` preset the best plan its own stages build?

    python benches/sweep.py [--profile tiny] [--windows 8] [--seed 0] [--json out.json]
        [--placements NAME ...] [--packings NAME ...] [--replications NAME ...] [--loads window|previous]

Every registered placement × packing × replication (`routepack.stages`) plans the profile's
successive synthetic windows (one more is generated first, for history) and is scored by
`routepack.simulate`; the table is sorted by median step time, with min/max over windows,
throughput over the `routepack` preset's and over the best baseline's, cross-node bytes per
token and planner wall time, the preset's row marked. The same run as
``routepack bench --sweep`` (this script calls it: one implementation, `routepack.sweep`).

`tiny` runs all 60 combinations over 8 windows in a few minutes on a 2-core machine; for
`flash`, narrow it, e.g.::

    python benches/sweep.py --profile flash --windows 4 --placements eplb eplb_hierarchical routepack \\
        --packings kk routepack --replications none hot_n routepack
"""

from __future__ import annotations

import sys

from routepack.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--sweep", *sys.argv[1:]]))
