"""Progress bars for every long loop of ra-lens: tqdm's bar on a terminal or in a notebook, and
plain lines on stderr everywhere else (``!ra-lens`` in a notebook, ``nohup``, a log file), where
a bar redrawn with carriage returns would be either hidden or garbage.

>>> import io
>>> log = io.StringIO()
>>> for _ in tqdm(range(4), desc="demo", file=log):
...     pass
>>> [line.split(",")[0] for line in log.getvalue().splitlines()]
['demo: 0/4 (0%)', 'demo: 1/4 (25%)', 'demo: 2/4 (50%)', 'demo: 3/4 (75%)', 'demo: 4/4 (100%)']
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import std
from tqdm.auto import tqdm as auto_tqdm

#: A plain line at least every this many seconds while a step is long, besides one per 10 %.
LINE_EVERY_S = 30.0


def tqdm(*args: Any, **kwargs: Any) -> std.tqdm:
    """`tqdm.auto.tqdm(*args, **kwargs)` where its bar can be seen (the stream is a terminal, or
    this runs in a Jupyter kernel), else a bar writing one plain line per 10 % of `total` and at
    least every `LINE_EVERY_S` seconds, with the elapsed and remaining time, to the same stream
    (stderr unless `file=`). The same object either way: iterate it, `update`, `close`, `with`."""
    stream = kwargs.get("file") or sys.stderr
    if kwargs.get("disable") or getattr(stream, "isatty", lambda: False)() or _in_kernel():
        return auto_tqdm(*args, **kwargs)
    if kwargs.get("leave") is False:  # an inner loop's passing bar: as lines, only noise in a log
        return auto_tqdm(*args, **{**kwargs, "disable": True})
    kwargs["file"] = _Lines(stream)
    kwargs.pop("bar_format", None)
    return _LineBar(*args, **kwargs, mininterval=0, miniters=1)


def _in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (tqdm.auto draws a widget there)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _Lines:
    """The stream a `_LineBar` writes to, less tqdm's own carriage returns and newlines."""

    def __init__(self, stream: Any) -> None:  # a text stream (sys.stderr, io.StringIO)
        self.stream = stream

    def write(self, text: str) -> None:
        if text not in ("", "\r", "\n"):
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class _LineBar(std.tqdm):  # type: ignore[misc]
    """tqdm whose every display is a whole line, written when the percentage passes a tenth, at
    least every `LINE_EVERY_S` seconds, and at the end."""

    _last: tuple[int, float, float] | None = None  # (tenth, time, n) of the last line written

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing a bar that does not stay (leave=False): nothing to clear
            return True
        d = self.format_dict
        total = d["total"]
        tenth = int(10 * d["n"] / total) if total else -1
        now = time.monotonic()
        if self._last is not None:
            same_tenth, recent = tenth == self._last[0], now - self._last[1] < LINE_EVERY_S
            # nothing new (close displays once more), or neither a new tenth nor time for a line
            if d["n"] == self._last[2] or (same_tenth and recent):
                return True
        self._last = (tenth, now, d["n"])
        elapsed = self.format_interval(d["elapsed"])
        if total:
            rate = d["n"] / d["elapsed"] if d["elapsed"] > 0 and d["n"] else None
            left = self.format_interval((total - d["n"]) / rate) if rate else "?"
            done = f"{d['n']:g}/{total:g} ({100 * d['n'] / total:.0f}%)"
            line = f"{d['prefix']}: {done}, {elapsed} elapsed, {left} left"
        else:
            line = f"{d['prefix']}: {d['n']:g}, {elapsed} elapsed"
        self.fp.write(line + "\n")
        self.fp.flush()
        return True
