"""A minimal progress bar on stderr (no dependency): model assembly and long prompt processing."""
from __future__ import annotations

import sys
import time


class Progress:
    """Redraws at most every 0.2 s; prints a final line on close. Silent when disabled."""

    def __init__(self, total: int, label: str, unit: str = "tok", enabled: bool = True, stream=None):
        self.total = max(int(total), 1)
        self.label = label
        self.unit = unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and self.interactive and (now - self._last_draw >= 0.2 or self.done >= self.total):
            self._last_draw = now
            self._draw()

    def _fmt(self, n: float) -> str:
        if self.unit == "B":
            return f"{n / 2**20:.0f} MiB"
        return f"{n:.0f} {self.unit}"

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        self.stream.write(f"\r{self.label} [{bar}] {self._fmt(self.done)}/{self._fmt(self.total)} "
                          f"{self._fmt(rate)}/s eta {eta:.0f}s ")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
