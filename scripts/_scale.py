"""The growth of a per-rank cost with the world size: a least-squares line, and its value at the
16,384 ranks no machine here runs."""

from __future__ import annotations

import statistics

TARGET_WORLD = 16384


def fit(worlds: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares ``(base, slope)`` of ``base + slope * world`` through the points."""
    mean_w, mean_v = statistics.fmean(worlds), statistics.fmean(values)
    var = sum((w - mean_w) ** 2 for w in worlds)
    slope = sum((w - mean_w) * (v - mean_v) for w, v in zip(worlds, values, strict=True)) / var
    return mean_v - slope * mean_w, slope
