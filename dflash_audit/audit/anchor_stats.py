"""Statistics of two samplers' anchor draws, for the ``anchors`` check
(:mod:`dflash_audit.audit.checks.anchors`): per-position frequencies (one z per position and a
pooled chi-square), and the shape of each draw in rank space (the ranks of its anchors among the
row's valid positions): strides, gaps and location, compared draw by draw.

Draws are independent of each other, so a statistic of each draw (its mean rank, its smallest
and largest gap) compares two samplers by a two-sample rank test (Mann-Whitney) whatever the
joint law of the anchors inside one draw; that is what a sampler with uniform per-position
frequencies but dependent anchors (a strided one whose start wraps around) changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: |z| beyond which two samplers differ (a uniform sampler exceeds 6 about once in 10^9).
Z_LIMIT = 6.0
#: p-value below which the pooled chi-square of the per-position frequencies differs.
P_LIMIT = 1e-9
#: Positions drawn fewer times than this (mean of both sides) stay out of the pooled
#: chi-square (its tail is not chi-square for rare counts).
MIN_EXPECTED = 5.0


def frequency_z(c: torch.Tensor, r: torch.Tensor, draws: int, size: int) -> torch.Tensor:
    """[size] two-proportion z per position: how often the candidate's ``c`` (valid anchor
    positions, int64) drew it against the reference's ``r``, over ``draws`` draws each."""
    nc = torch.bincount(c, minlength=size).double()[:size]
    nr = torch.bincount(r, minlength=size).double()[:size]
    p = (nc + nr) / (2 * draws)
    return (nc - nr) / (2 * draws * p * (1 - p)).clamp_min(1e-12).sqrt()


def pooled_p(z: torch.Tensor, c: torch.Tensor, r: torch.Tensor, draws: int) -> float:
    """p-value of sum z^2 over the positions both sides draw at least MIN_EXPECTED times on
    average (chi-square, one degree of freedom each; the within-draw dependence of anchors
    drawn without replacement only makes it conservative); 1.0 when none."""
    size = z.numel()
    counts = (torch.bincount(c, minlength=size)[:size] + torch.bincount(r, minlength=size)[:size])
    p = counts.double() / (2 * draws)
    keep = (counts >= 2 * MIN_EXPECTED) & (p < 1)
    if not keep.any():
        return 1.0
    df = torch.tensor(float(keep.sum()), dtype=torch.float64)
    x = (z[keep] ** 2).sum()
    return float(torch.special.gammaincc(df / 2, x / 2))


def conditional_p(c: torch.Tensor, r: torch.Tensor, positions: list[int]) -> float:
    """p-value that the candidate's draws ``c`` and the reference's ``r`` (valid anchor
    positions, int64) are spread alike over ``positions`` (each side's counts there, as shares
    of its own total there: chi-square homogeneity over the positions both sides draw at least
    MIN_EXPECTED times on average). A sampler that excludes some positions and draws the rest
    uniformly keeps it high; one that favours some positions does not. 1.0 when < 2 positions."""
    if len(positions) < 2:
        return 1.0
    idx = torch.tensor(positions)
    size = int(idx.max()) + 1
    nc = torch.bincount(c, minlength=size)[idx].double()
    nr = torch.bincount(r, minlength=size)[idx].double()
    keep = (nc + nr) >= 2 * MIN_EXPECTED
    nc, nr = nc[keep], nr[keep]
    if nc.numel() < 2:
        return 1.0
    total = nc + nr
    ec, er = total * nc.sum() / total.sum(), total * nr.sum() / total.sum()
    x = ((nc - ec) ** 2 / ec + (nr - er) ** 2 / er).sum()
    df = torch.tensor(float(nc.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, x / 2))


def mann_whitney_z(x: torch.Tensor, y: torch.Tensor) -> float:
    """Two-sample Mann-Whitney z of ``x`` against ``y`` (1-D, any values; ties averaged and
    corrected); positive when x tends to be larger, 0 when every value ties."""
    n1, n2 = x.numel(), y.numel()
    both = torch.cat([x, y]).double()
    values, inverse, counts = torch.unique(both, return_inverse=True, return_counts=True)
    upper = counts.cumsum(0).double()
    mid = upper - (counts.double() - 1) / 2  # average rank of each tied group
    u = float(mid[inverse[:n1]].sum()) - n1 * (n1 + 1) / 2
    N = n1 + n2
    ties = float((counts.double() ** 3 - counts.double()).sum())
    var = n1 * n2 / 12 * ((N + 1) - ties / (N * (N - 1)))
    return 0.0 if var <= 0 else (u - n1 * n2 / 2) / var ** 0.5


@dataclass
class DrawShape:
    """The shape of every draw in rank space (``k`` anchors among ``n`` valid positions):
    ``ranks`` [K, k] sorted; ``gaps`` [K, k] cyclic gaps (the last one wraps around past the
    row's end); ``stride`` [K] the gap shared by all but at most one of a draw's cyclic gaps
    (-1 when none; for k = 2 the smaller gap); ``linear`` [K] the draw is an arithmetic
    progression of that stride that does not wrap around."""

    ranks: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.ranks.shape[1]

    @property
    def gaps(self) -> torch.Tensor:
        wrap = self.ranks[:, :1] + self.n - self.ranks[:, -1:]
        return torch.cat([self.ranks.diff(dim=1), wrap], 1)

    @property
    def stride(self) -> torch.Tensor:
        g = self.gaps
        if self.k == 2:
            return g.min(1).values
        mode = g.mode(1).values
        return torch.where((g == mode[:, None]).sum(1) >= self.k - 1, mode, -1)

    @property
    def linear(self) -> torch.Tensor:
        return (self.ranks.diff(dim=1) == self.stride[:, None]).all(1)

    def features(self) -> dict[str, torch.Tensor]:
        """Per-draw statistics the rank test compares: mean rank, smallest and largest gap."""
        g = self.gaps
        return {"mean rank": self.ranks.double().mean(1), "smallest gap": g.min(1).values,
                "largest gap": g.max(1).values}


def draw_shape(draws: torch.Tensor, valid: torch.Tensor, pool: torch.Tensor) -> DrawShape | None:
    """The :class:`DrawShape` of ``draws`` [K, A] (``valid`` [K, A] bool) among the sorted
    valid positions ``pool`` [n]; None unless every draw holds the same number k >= 2 of
    distinct anchors, all in the pool."""
    counts = valid.sum(1)
    if draws.shape[0] == 0 or not bool((counts == counts[0]).all()) or int(counts[0]) < 2:
        return None
    k = int(counts[0])
    chosen = torch.stack([row[ok] for row, ok in zip(draws, valid)]).sort(1).values
    ranks = torch.searchsorted(pool, chosen)
    if bool((ranks >= pool.numel()).any()) or not bool((pool[ranks.clamp(
            max=pool.numel() - 1)] == chosen).all()) or bool((chosen.diff(dim=1) == 0).any()):
        return None
    return DrawShape(ranks, pool.numel())
