"""Compiled (numba) vocabulary sums of the sampling acceptance: one read of each row.

Why: the gradient sampler's scoring pass needs, per proposal, five sums over the
vocabulary of q and the target p (the stop set's mass, the positive part of p - q, and
three of q's moments). As tensor ops they are a dozen passes over each `[rows, V]` chunk
plus a dispatch per op and chunk; a compiled loop reads a row of q and of p once, with
the row in L1. The exponentials stay in torch (vectorised; numba's `exp` is a scalar
libm call here). Accumulated in float64. Cached on disk (`cache=True`).
"""

from __future__ import annotations

import numba
import numpy as np

# columns of `acceptance_sums`' output
MASS, OVERHANG, S, Q2, Q2G = range(5)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def acceptance_sums(e, total, p, p_index, keep, out):  # pragma: no cover - compiled
    """Per row r of `e [N, V]` (`exp((z - m) / T)`, `total [N]` its row sums, so q = e /
    total) and its target row `p[p_index[r]]`, with `keep [V]` 1.0 off the stop set S and
    0.0 on it, writes `out[r] = (M, sum_{v not in S} [p - q]_+, s, Q, Q_G)`: M = <p, keep>,
    G = 1 where p > q off S, 1/2 where p = q off S, 0 elsewhere, s = <q, G>, Q = <q, q>,
    Q_G = <q^2, G> (`acceptance.scores_with_gradient_moments`' docstring)."""
    rows, vocab = e.shape
    for r in range(rows):
        row = e[r]
        pr = p[p_index[r]]
        inv = 1.0 / np.float64(total[r])
        mass = 0.0
        over = 0.0
        s = 0.0
        q2 = 0.0
        q2g = 0.0
        for v in range(vocab):
            q = np.float64(row[v]) * inv
            pv = np.float64(pr[v])
            k = np.float64(keep[v])
            gap = pv - q
            sign = 1.0 if gap > 0 else (-1.0 if gap < 0 else 0.0)
            g = (1.0 + sign) * 0.5 * k
            mass += pv * k
            over += max(gap, 0.0) * k
            s += q * g
            q2 += q * q
            q2g += q * q * g
        out[r, MASS] = mass
        out[r, OVERHANG] = over
        out[r, S] = s
        out[r, Q2] = q2
        out[r, Q2G] = q2g
