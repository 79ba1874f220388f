"""A rounds progress bar that shows the latest test accuracy, and the evaluation's bar (rank 0 only)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """tqdm over rounds; a no-op when disabled (other ranks, or ``progress: false``)."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, desc: str = "rounds") -> None:
        self._bar = (
            tqdm(total=total, initial=initial, desc=desc, unit="round", file=sys.stderr, dynamic_ncols=True)
            if enabled
            else None
        )

    def update(self, done: int, row: dict[str, Any] | None) -> None:
        if self._bar is None:
            return
        self._bar.update(done - self._bar.n)
        if row is not None:
            self._bar.set_postfix(acc=f"{row['test_accuracy']:.4f}", loss=f"{row['test_loss']:.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


#: seconds an evaluation runs before its bar appears (a quick one shows none)
EVAL_BAR_DELAY = 3.0


class EvalBar:
    """tqdm over the samples one evaluation scores, shown only once it has taken
    :data:`EVAL_BAR_DELAY` seconds and removed when done; a no-op when disabled."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self._bar = (
            tqdm(
                total=total,
                desc="evaluate",
                unit="sample",
                unit_scale=True,
                delay=EVAL_BAR_DELAY,
                leave=False,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            if enabled and total > 0
            else None
        )

    def tick(self, k: int) -> None:
        if self._bar is not None:
            self._bar.update(k)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
