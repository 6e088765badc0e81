"""Statistics for comparing seeds: mean and sample standard deviation, and Welch's one-sided t-test with
its Student-t tail computed here (scipy.stats is used where importable; the built-in numbers agree with it,
tested), so scripts.reproduce needs no scipy."""
from __future__ import annotations

import math


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function, modified Lentz evaluation."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            return result
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def betainc_regularized(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc_regularized needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side; use symmetry otherwise
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with df (possibly fractional) degrees of freedom."""
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc_regularized(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def welch_one_sided(baseline: list[float], candidate: list[float], margin: float = 0.0) -> dict:
    """Test H1: mean(baseline) - mean(candidate) > margin, variances not assumed equal.

    scipy.stats is used when importable; the built-in Student-t tail otherwise (same numbers, tested)."""
    if len(baseline) < 2 or len(candidate) < 2:
        raise ValueError(f"Welch's t-test needs at least 2 runs per side, got {len(baseline)} baseline and "
                         f"{len(candidate)} candidate (hint: run more seeds)")
    if not all(math.isfinite(v) for v in [*baseline, *candidate]):
        raise ValueError(f"Welch's t-test needs finite values, got baseline {baseline} and candidate {candidate} "
                         "(hint: a diverged run has no score to compare)")
    mb, sb = mean_std(baseline)
    mc, sc = mean_std(candidate)
    vb, vc = sb * sb / len(baseline), sc * sc / len(candidate)
    flat = [side for side, v in (("baseline", vb), ("candidate", vc)) if v == 0.0]
    if flat:  # identical runs mean the seed changed nothing: one sample, not certainty (and t borrows the other side's
        # spread alone, which made three copies of one run a significant record)
        raise ValueError(f"Welch's t-test needs spread on each side: every {' and every '.join(flat)} run has the same "
                         f"value (baseline mean {mb!r}, candidate mean {mc!r}); hint: check that train.seed reaches the "
                         "runs (identical runs are not independent samples)")
    t = (mb - mc - margin) / math.sqrt(vb + vc)
    df = (vb + vc) ** 2 / (vb ** 2 / (len(baseline) - 1) + vc ** 2 / (len(candidate) - 1))
    try:
        from scipy import stats
    except ImportError:
        return {"t": t, "df": df, "p_value": student_t_sf(t, df), "method": "builtin"}
    result = stats.ttest_ind([v - margin for v in baseline], candidate, equal_var=False, alternative="greater")
    return {"t": float(result.statistic), "df": df, "p_value": float(result.pvalue), "method": "scipy"}
