"""An exact streaming summary of many repeated float samples: value -> count.

The simulator's inter-token gaps repeat: every request decoded in a step sees the same gap
(the step's end minus the previous step's end), so 100k requests and 17M gaps hold only about
as many distinct values as there were steps. Storing the counts instead of every sample keeps
memory proportional to the steps, and percentiles stay exact (they read the same order
statistics a sorted list of every sample would).
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable, Iterator, Union


class ValueCounts:
    """A multiset of floats. Iterating yields every sample, in ascending order.

    `add` only appends to two pending lists (a simulation adds once per step, and a run's
    many instances' maps would each be a cold dict by then); `counts` folds them in, in the
    order they were added, at the next read: the map and its order are those of adding each
    at once."""

    __slots__ = ("_counts", "_n", "_values", "_weights")

    def __init__(self, values: Iterable[float] = ()) -> None:
        self._counts: dict[float, int] = {}
        self._n = 0
        self._values: list[float] = []  # added, not yet folded into _counts
        self._weights: list[int] = []
        self.extend(values)

    @property
    def counts(self) -> dict[float, int]:
        """value -> count, in order of first appearance (read-only)."""
        if self._values:
            counts = self._counts
            for value, count in zip(self._values, self._weights):
                counts[value] = counts.get(value, 0) + count
            self._values, self._weights = [], []
        return self._counts

    def add(self, value: float, count: int = 1) -> None:
        self._values.append(value)
        self._weights.append(count)
        self._n += count

    def extend(self, values: Union[Iterable[float], "ValueCounts"]) -> None:
        if isinstance(values, ValueCounts):
            for value, count in values.counts.items():
                self.add(value, count)
        else:
            for value in values:
                self.add(value)

    def append(self, value: float) -> None:
        """array/list-compatible alias of `add`."""
        self.add(value)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[float]:
        counts = self.counts
        for value in sorted(counts):
            for _ in range(counts[value]):
                yield value

    def sorted_runs(self) -> tuple[list[float], list[int]]:
        """Distinct values ascending, and the cumulative count through each."""
        counts = self.counts
        values = sorted(counts)
        cumulative, total = [], 0
        for value in values:
            total += counts[value]
            cumulative.append(total)
        return values, cumulative

    def mean(self) -> float:
        if not self._n:
            return math.nan
        return math.fsum(value * count for value, count in self.counts.items()) / self._n

    def percentile(self, p: float) -> float:
        """Linear interpolation between closest ranks (numpy's default), as over the full
        sorted sample."""
        if not self._n:
            return math.nan
        values, cumulative = self.sorted_runs()
        return _interpolate(values, cumulative, self._n, p)

    def percentiles(self, ps: Iterable[float]) -> dict[float, float]:
        values, cumulative = self.sorted_runs()
        return {p: _interpolate(values, cumulative, self._n, p) if self._n else math.nan
                for p in ps}


def _interpolate(values: list[float], cumulative: list[int], n: int, p: float) -> float:
    k = (n - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, n - 1)
    lo_value, hi_value = _at_rank(values, cumulative, lo), _at_rank(values, cumulative, hi)
    return lo_value + (hi_value - lo_value) * (k - lo)


def _at_rank(values: list[float], cumulative: list[int], rank: int) -> float:
    """The sample at 0-based `rank` of the sorted multiset."""
    return values[bisect.bisect_right(cumulative, rank)]
