"""Confidence intervals over seeds: a mean's 95% Student-t interval and a difference's 95% Welch interval.

The chapters' seeded experiments and the claims table report effects this way (a run of a few seeds is
too few for a normal approximation: with 3 seeds the t quantile is 4.30, not 1.96)."""

from __future__ import annotations

import math
import statistics

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; beyond 30 the normal's 1.96 is close.
T_975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% Student-t interval; a run that never got there (inf) makes all three inf."""
    n = len(values)
    mean = statistics.fmean(values)
    if not math.isfinite(mean):
        return mean, mean, mean
    if n < 2:
        return mean, mean, mean
    half = T_975[min(n - 1, len(T_975)) - 1] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def difference_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) − mean(b) and its 95% Welch interval (unequal variances)."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:  # every seed gave the same value (say, no sum right yet): no spread, no Welch df
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = T_975[min(max(int(df), 1), len(T_975)) - 1] * math.sqrt(va + vb)
    return diff, diff - half, diff + half
