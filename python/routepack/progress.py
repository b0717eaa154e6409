"""Progress on stderr for the long commands (``routepack bench``, ``calibrate``, ``measure``).

On a terminal it is a tqdm bar. Anywhere else (a log file, a pipe, a CI job) a bar is
useless, and tqdm's default there (``disable=None``) is silence, which leaves a log empty for
minutes. So off a terminal `bar` prints plain lines instead: one when it starts, then at
most one every ``interval`` seconds, and one when it ends, each formatted by tqdm's own
``format_meter`` (``calibrate: 40/120 points, 01:10 elapsed, 02:20 left, expert_gemm``).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Optional

#: Seconds between two plain progress lines off a terminal.
INTERVAL_S = 10.0

_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit}s, {elapsed} elapsed, {remaining} left{postfix}"


class Lines:
    """The subset of tqdm's interface the commands use (``update``, ``set_postfix_str``,
    ``close``), printed as plain lines."""

    def __init__(self, total: int, unit: str, desc: str, file: IO[str], interval: float = INTERVAL_S) -> None:
        self.total, self.unit, self.desc, self.file, self.interval = total, unit, desc, file, interval
        self.n = 0
        self.postfix = ""
        self.start = time.monotonic()
        self._shown_at = -float("inf")
        self._shown_n: Optional[int] = None
        self._show()

    def _show(self) -> None:
        from tqdm import tqdm

        now = time.monotonic()
        text = tqdm.format_meter(
            self.n,
            self.total,
            now - self.start,
            prefix=self.desc,
            unit=self.unit,
            postfix=self.postfix or None,
            bar_format=_FORMAT,
        )
        self.file.write(text + "\n")
        self.file.flush()
        self._shown_at, self._shown_n = now, self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._shown_at >= self.interval or self.n >= self.total:
            self._show()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def close(self) -> None:
        if self._shown_n != self.n:
            self._show()


class _Off:
    """No progress (``--quiet``)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def bar(total: int, unit: str, desc: str, show: bool = True, file: Optional[IO[str]] = None) -> Any:
    """A progress display on ``file`` (stderr): a tqdm bar on a terminal, plain `Lines`
    elsewhere, nothing when ``show`` is false."""
    if not show:
        return _Off()
    out = sys.stderr if file is None else file
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, unit=unit, desc=desc, file=out, leave=False)
    return Lines(total, unit, desc, out)


__all__ = ["INTERVAL_S", "Lines", "bar"]
