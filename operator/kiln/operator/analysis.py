"""Canary analysis: what the routers measured for each revision over one interval, and the
verdict on the canary against the stable revision. Pure: scrape.py reads the routers'
/metrics; the rollout's step machine (rollout.py) acts on the verdict.

All figures are the routers' own, so they are what clients saw: requests and their status
codes, time to first token and inter-token latency of streamed responses, and the quality
gate's teacher-forced greedy agreement from mirrored requests. Counters only grow, so an
interval's figures are the difference of two snapshots, taken router by router (canary.py); a
router that restarted in between counts from zero again, all of its counters at once."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .models import Analysis

PASS, FAIL, INCONCLUSIVE = "Pass", "Fail", "Inconclusive"
CLIENT_GONE = "499"  # the client hung up: nobody's failure
HISTOGRAMS = {"kiln_router_time_to_first_token_seconds": "ttft",
              "kiln_router_inter_token_latency_seconds": "itl"}


@dataclass
class Figures:
    """One revision's counters as a router reports them (or their sum, or their increase)."""
    requests: float = 0.0  # answered (499s left out), and attempts another replica answered instead
    errors: float = 0.0  # of those, 5xx and the attempts
    ttft: dict[float, float] = field(default_factory=dict)  # cumulative bucket counts by upper bound
    itl: dict[float, float] = field(default_factory=dict)
    tokens: float = 0.0  # mirrored tokens this revision scored against the stable revision's
    agreed: float = 0.0  # of those, positions where its argmax was the stable revision's token

    def plus(self, other: Figures) -> Figures:
        def add(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
            return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in a.keys() | b.keys()}
        return Figures(self.requests + other.requests, self.errors + other.errors, add(self.ttft, other.ttft),
                       add(self.itl, other.itl), self.tokens + other.tokens, self.agreed + other.agreed)

    def minus(self, before: Figures) -> Figures:
        """What happened since `before` (counters only grow: see fell_below for a restart)."""
        def sub(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
            return {le: n - b.get(le, 0.0) for le, n in a.items()}
        return Figures(self.requests - before.requests, self.errors - before.errors, sub(self.ttft, before.ttft),
                       sub(self.itl, before.itl), self.tokens - before.tokens, self.agreed - before.agreed)

    def fell_below(self, before: Figures) -> bool:
        """Whether any counter went down since `before`: its router restarted."""
        def down(a: dict[float, float], b: dict[float, float]) -> bool:
            return any(a.get(le, 0.0) < n for le, n in b.items())
        return (self.requests < before.requests or self.errors < before.errors or self.tokens < before.tokens
                or self.agreed < before.agreed or down(self.ttft, before.ttft) or down(self.itl, before.itl))


Sample = tuple[str, Mapping[str, str], float]  # (sample name, labels, value) from a metrics page


def figures(samples: Iterable[Sample]) -> dict[str, Figures]:
    """Per-revision figures from the samples of every router's metrics page."""
    out: dict[str, Figures] = {}
    for name, labels, value in samples:
        revision = labels.get("revision")
        if revision is None or not math.isfinite(value):  # a count that is NaN or infinite is garbage
            continue
        f = out.setdefault(revision, Figures())
        if name == "kiln_router_requests_total" and labels.get("code") != CLIENT_GONE:
            f.requests += value
            f.errors += value if labels.get("code", "").startswith("5") else 0.0
        elif name == "kiln_router_retries_total":
            # Attempts this revision could not take (it refused, its replica refused the connection),
            # sent again to another replica, often the stable revision's: counted there alone, a
            # canary that refuses requests showed no error at all.
            f.requests += value
            f.errors += value
        elif name == "kiln_router_mirror_tokens_total":
            f.tokens += value
        elif name == "kiln_router_mirror_agreed_total":
            f.agreed += value
        elif name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
            buckets = getattr(f, HISTOGRAMS[name.removesuffix("_bucket")])
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated inside its bucket the way
    Prometheus' histogram_quantile() does; None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower  # beyond the last finite bound: its bound is the best we know
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


@dataclass(frozen=True)
class Check:
    verdict: str  # Pass | Fail | Inconclusive
    figures: dict[str, float | int | None]  # what status.rollout.analysis shows
    failed: list[str]  # the checks that failed, each with its figures, for events and status

    def summary(self) -> str:
        return "; ".join(self.failed) if self.failed else self.verdict.lower()


def ratio(canary: float | None, stable: float | None) -> float | None:
    if canary is None or stable is None or stable <= 0:
        return None
    return canary / stable


def p95_ratio(canary: Mapping[float, float], stable: Mapping[float, float], least: int) -> float | None:
    """Canary p95 over stable p95, when each histogram holds at least `least` observations (one
    slow stream among fifty short answers says nothing about the canary's tail)."""
    def p95(buckets: Mapping[float, float]) -> float | None:
        return quantile(0.95, buckets) if max(buckets.values(), default=0.0) >= max(least, 1) else None
    return ratio(p95(canary), p95(stable))


def error_baseline(stable: Figures, least: int) -> float | None:
    """The stable revision's 5xx share over the interval, which the canary's is judged beside:
    errors both revisions see (requests no model can answer, a shared dependency down) are no
    regression. None when stable answered fewer than `least` (a 100% step sends it nothing): a
    thin baseline never loosens maxErrorRate, which is then the absolute threshold it always was."""
    return stable.errors / stable.requests if stable.requests >= max(least, 1) else None


def check(canary: Figures, stable: Figures, analysis: Analysis) -> Check:
    """Canary against stable over one interval (both are `minus`-ed figures). Too few canary
    requests: inconclusive, unless a latency ratio fails; the error rate fails past maxErrorRate
    above the stable revision's (error_baseline), and past maxErrorRate alone it is inconclusive,
    never a pass; a latency ratio is judged only where both revisions streamed at least
    minRequests responses, answered or not (a canary whose every stream stalls until its client
    leaves answers nothing, only 499s, but its waits are timed). Too few mirrored tokens leaves
    quality unjudged (inconclusive unless another check failed: a canary failing every request
    scores no tokens, and that must not hide its errors). The agreement threshold is relative to
    the noise floor: stable scoring its own tokens on another replica (1.0 when the interval had
    too few of those)."""
    ttft = p95_ratio(canary.ttft, stable.ttft, analysis.minRequests)
    itl = p95_ratio(canary.itl, stable.itl, analysis.minRequests)
    error_rate = canary.errors / canary.requests if canary.requests else None
    baseline = error_baseline(stable, analysis.minRequests)
    agreement = canary.agreed / canary.tokens if canary.tokens else None
    quality = analysis.quality
    floor = stable.agreed / stable.tokens if quality and stable.tokens >= quality.minTokens else None
    shown: dict[str, float | int | None] = {
        "canaryRequests": int(canary.requests), "stableRequests": int(stable.requests),
        "errorRate": rounded(error_rate), "stableErrorRate": rounded(baseline), "ttftP95Ratio": rounded(ttft),
        "itlP95Ratio": rounded(itl), "greedyAgreement": rounded(agreement), "agreementTokens": int(canary.tokens),
        "noiseFloor": rounded(floor), "noiseFloorTokens": int(stable.tokens)}
    enough = canary.requests >= analysis.minRequests
    quality_judged = enough and quality is not None and canary.tokens >= quality.minTokens
    failed = []
    # baseline + maxErrorRate, not their difference: with a clean stable revision exactly the old threshold.
    if enough and error_rate is not None and error_rate > (baseline or 0.0) + analysis.maxErrorRate:
        failed.append(f"error rate {error_rate:.3f} > {analysis.maxErrorRate}"
                      + (f" + stable's {baseline:.3f}" if baseline else ""))
    # Failing as often as stable is no regression, nor any evidence for the canary: a shared outage
    # where both fail every request must not pass it (a Pass advances steps and clears a held Fail).
    excused = error_rate is not None and not failed and error_rate > analysis.maxErrorRate
    if ttft is not None and ttft > analysis.maxTimeToFirstTokenP95Ratio:
        failed.append(f"TTFT p95 ratio {ttft:.2f} > {analysis.maxTimeToFirstTokenP95Ratio}")
    if itl is not None and itl > analysis.maxInterTokenLatencyP95Ratio:
        failed.append(f"ITL p95 ratio {itl:.2f} > {analysis.maxInterTokenLatencyP95Ratio}")
    if quality and quality_judged and agreement is not None:
        needed = quality.minGreedyAgreement * (floor if floor is not None else 1.0)
        if agreement < needed:
            failed.append(f"greedy agreement {agreement:.3f} < {needed:.3f} (minGreedyAgreement "
                          f"{quality.minGreedyAgreement} x noise floor {floor if floor is not None else 1.0:.3f}, "
                          f"{int(canary.tokens)} tokens)")
    if failed:
        return Check(FAIL, shown, failed)
    return Check(INCONCLUSIVE if not enough or excused or (quality and not quality_judged) else PASS, shown, [])


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
