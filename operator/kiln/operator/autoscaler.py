"""The builtin autoscaler's decision: a pure function of the load samples, the spec's
autoscaling block, the state it left last time and the time now, after Knative's KPA.

- load is the engine's own queue: kiln:num_requests_waiting + kiln:num_requests_running summed
  over the ready engine pods that answered, plus the requests the router holds at zero;
- desired = ceil(load / targetQueueDepth), averaged over `stableWindow`;
- a `panicWindow` average takes over when it asks for PANIC_THRESHOLD x the ready replicas:
  scale up at once, and never down until a stable window (less a tenth, the step panic-until
  moves by) passed without panic;
- scale-down only once demand stayed lower for `scaleDownDelay`, to the most it asked for in
  the last `scaleDownDelay`, never below what the panic window asks, and never while a replica the last decision ordered is still loading (it is
  capacity on its way);
- no sample, or only stale ones: hold (a missing sample is never zero load);
- clamped to [minReplicas, maxReplicas] at once (a lowered maxReplicas too); up by at most
  MAX_SCALE_UP_RATE x the ready replicas.

State that must survive an operator restart (panic-until, the scale-down timer, the last
decision) is a `ScalerState`, kept in the InferenceService's status; the samples are not:
after a restart the windows refill, and the persisted state holds replicas meanwhile."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .models import Autoscaling, seconds

# Knative's defaults (panic-threshold-percentage 200): panic when the short window asks for
# twice the replicas that are ready.
PANIC_THRESHOLD = 2.0
# Knative allows 1000x up per decision, fit for containers that start in a second. An LLM
# replica takes a GPU and minutes to load: at most double the ready replicas per decision
# (two from zero or one), so a spike cannot order a fleet before the first one serves.
MAX_SCALE_UP_RATE = 2.0


@dataclass(frozen=True)
class Sample:
    time: float  # seconds since the epoch, when it was scraped
    load: float  # waiting + running requests over the ready pods that answered, + held at the router


@dataclass(frozen=True)
class ScalerState:
    replicas: int  # the last decision
    panic_until: float | None = None
    lower_since: float | None = None  # when demand fell below `replicas` (the scale-down timer)
    # The last scaleDownDelay's asks below `replicas` as a running maximum: (replicas, when last
    # asked), the asks decreasing and the times increasing. Its first is where a scale-down goes.
    # The last is the latest pass's ask, asked until now: it keeps the time its run began, so
    # status is not rewritten on every pass while the delay runs.
    lower_asks: tuple[tuple[int, float], ...] = ()
    last_scale: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str  # the ScalingReady condition's reason
    message: str
    mode: str  # stable | panic
    load: float | None  # the stable window's average load; None without data
    ok: bool = True  # ScalingReady's status


# How far back a panic window shorter than this looks when it holds no sample of its own: two of the
# builtin autoscaler's 2 s ticks and a bit, so one missed scrape is not blindness, three are.
RECENT_S = 5.0


def average(samples: list[Sample], since: float) -> float | None:
    window = [s.load for s in samples if s.time >= since]
    return sum(window) / len(window) if window else None


def decide(samples: list[Sample], spec: Autoscaling, state: ScalerState, ready: int, starting: int,
           now: float, elsewhere: int = 0) -> tuple[Decision, ScalerState]:
    """`ready`: replicas serving; `starting`: replicas created but not ready yet (loading);
    `elsewhere`: other revisions' replicas serving the same load (an update's old revision, which
    serves it all while the new one loads): capacity the panic threshold and the rate limit count."""
    stable_window, panic_window = seconds(spec.stableWindow), seconds(spec.panicWindow)
    # Times a clock ahead of this one wrote (a skewed former leader's, or ours before it stepped
    # back) are held to what this clock could have written, or they would hold replicas up for
    # as long as the skew.
    if state.panic_until is not None and state.panic_until > now + stable_window:
        state = replace(state, panic_until=now + stable_window)
    if state.lower_since is not None and state.lower_since > now:
        state = replace(state, lower_since=now)
    if any(at > now for _, at in state.lower_asks):
        state = replace(state, lower_asks=tuple((ask, min(at, now)) for ask, at in state.lower_asks))
    # A maxReplicas lowered below the last decision applies at once, as an HPA's does: the
    # scale-down delay waits out demand, not a limit.
    if state.replicas > spec.maxReplicas:
        state = replace(state, replicas=spec.maxReplicas, last_scale=now, lower_since=None, lower_asks=())
    fresh = [s for s in samples if now - stable_window <= s.time <= now]
    stable_load = average(fresh, now - stable_window)
    # A panic window shorter than a tick or two holds one sample at most, and a missed scrape
    # leaves it empty: the stable window's average stands in, rather than holding as if blind.
    panic_load = average(fresh, now - panic_window)
    if panic_load is None:  # a panic window shorter than a tick or two, left empty by a missed scrape
        panic_load = average(fresh, now - max(panic_window, RECENT_S))
    if state.replicas < spec.minReplicas:  # a minReplicas raised applies at once too, metrics or not
        state = replace(state, replicas=spec.minReplicas, last_scale=now, lower_since=None, lower_asks=())
    current = state.replicas
    if panic_load is None or stable_load is None:  # nothing recent: hold, never guess zero
        return (Decision(current, "MetricsUnavailable", f"no load sample in the last "
                         f"{max(panic_window, RECENT_S):g}s; holding {current} replica(s)", "stable", None, ok=False),
                state)
    target = spec.targetQueueDepth
    want_stable = math.ceil(stable_load / target)
    want_panic = math.ceil(panic_load / target)
    panicking = state.panic_until is not None and now < state.panic_until
    serving = ready + elsewhere
    if want_panic > 0 and want_panic >= PANIC_THRESHOLD * max(serving, 1) and want_panic > current:
        panicking = True
        # Moved on in steps of a tenth of the window, not on every pass: held at maxReplicas or by
        # the rate limit, a panic rewrote status (which every router watches) every tick.
        if state.panic_until is None or now + stable_window - state.panic_until >= stable_window / 10:
            state = replace(state, panic_until=now + stable_window)
    if panicking:
        want = max(current, want_panic)  # up fast, never down while panicking
    else:
        want = want_stable
        state = replace(state, panic_until=None)
    limit = max(current, math.ceil(MAX_SCALE_UP_RATE * max(serving, 1)))
    capped = min(want, limit, spec.maxReplicas)
    capped = max(capped, spec.minReplicas)
    if capped < current:
        # Never below what the panic window asks: that is load coming back that the stable
        # average has not caught up with, and scaling it away would order it again at once.
        capped = min(max(capped, want_panic), current)
    # Only pods the last decision still lacks are serving capacity on its way; more (a warm
    # pool refilling, a rolling update's surge) must not hold a scale-down.
    loading = min(starting, max(current - ready, 0))
    if capped < current:
        # The delay ends at the most that demand asked for within the last scaleDownDelay, as
        # Knative and the HPA take the highest recommendation in their window, not at the last
        # sample's ask: an ask of now replaces the lower ones before it, and asks older than the
        # delay drop out, so every step down lands where the window says (one remembered peak
        # lost the asks between it and the step: 8 then 5 then 3 went 8 -> 3 in one step).
        since = state.lower_since if state.lower_since is not None else now
        delay = seconds(spec.scaleDownDelay)
        asked = state.lower_asks[:-1] + ((state.lower_asks[-1][0], now),) if state.lower_asks else ()
        asks = tuple((ask, at) for ask, at in asked if ask > capped and now - at < delay)
        last = state.lower_asks[-1] if state.lower_asks else None
        state = replace(state, lower_since=since,
                        lower_asks=asks + (last if last and last[0] == capped else (capped, now),))
        capped = state.lower_asks[0][0]
        if loading > 0:
            capped, waiting = current, f"{loading} replica(s) still loading"
        elif now - since < seconds(spec.scaleDownDelay):
            capped, waiting = current, f"demand lower for less than {spec.scaleDownDelay} (since " \
                                       "status.autoscaling.scaleDownSince)"
        else:
            waiting = ""
        if capped == current:
            return (Decision(current, "ScaleDownDelayed", f"load {stable_load:.1f} asks for {max(want, 0)}; "
                             f"holding {current}: {waiting}", "stable", stable_load), state)
    state = replace(state, lower_since=None, lower_asks=()) if capped >= current else state
    mode = "panic" if panicking else "stable"
    if capped != current:
        # Down to the window's most: every ask since was lower still, so the next step's delay
        # runs from when it was last asked (as a sliding window would), not from now.
        since, asks = None, ()
        if capped < current:  # the ask it lands on was asked until now if it is the latest one
            since, asks = now if len(state.lower_asks) == 1 else state.lower_asks[0][1], state.lower_asks[1:]
        state = replace(state, replicas=capped, last_scale=now, lower_since=since, lower_asks=asks)
    message = (f"load {stable_load:.1f} (panic window {panic_load:.1f}) at {target} per replica "
               f"asks for {want}; {capped} replica(s)")
    if want > spec.maxReplicas and capped == spec.maxReplicas:  # not merely held back by the rate limit
        return Decision(capped, "AtMaxReplicas", message + f" (maxReplicas {spec.maxReplicas})", mode,
                        stable_load), state
    return Decision(capped, "ScaledToZero" if capped == 0 else "Scaled", message, mode, stable_load), state
