"""The canary rollout's step machine: a pure function from the rollout's last state (kept in
status.rollout, so an operator restart resumes the same step), what this pass observed and
the latest analysis verdict, to the next state. reconcile.py brings the facts and the time.

A rollout starts when the spec's revision differs from the stable one. The canary first has
to become ready (step 0, within progressDeadline); then each step sends its weight of the
requests to it for its pause, with analysis every interval. After the last step the canary is
scaled to the stable revision's size (step len(steps)+1) and then promoted: it becomes the
stable revision and the old one drains and goes. `failureLimit` failed checks roll it back:
weight 0, Deployment removed, and not retried while the spec still asks for it (or asks for it
again, before going back to the stable revision), unless the kiln.dev/retry-rollout annotation
changes. A spec changed again mid-rollout makes the newest revision the canary; a spec changed
back to the stable revision drops the canary."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .analysis import FAIL, PASS, Check
from .models import Rollout, seconds
from .scaling import epoch, iso

PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK = "Progressing", "Paused", "Promoted", "RolledBack"
RETRY_ANNOTATION = "kiln.dev/retry-rollout"
RESUME_ANNOTATION = "kiln.dev/resume-rollout"
# A canary engine that failed to start this many times (restarts with a failed exit, never ready)
# is broken, not slow: rolled back at once instead of after progressDeadline.
FAILED_STARTS = 3


@dataclass(frozen=True)
class State:
    """status.rollout, as the step machine sees it (times in epoch seconds)."""
    phase: str
    stable: str
    canary: str | None = None
    step: int = 0
    since: float = 0.0  # when the current step (or the wait for readiness) began
    passed: int = 0  # passing checks in this step
    failed: int = 0  # failed checks in this rollout
    held: bool = False  # a check failed in this step and none has passed since: no promotion
    rolled_back: str | None = None
    retry_token: str | None = None
    resume_token: str | None = None
    analysis: dict[str, Any] | None = None
    message: str = ""
    # From step 1 on: since when the canary has had no ready replica, as first seen (None while ready).
    unready_since: float | None = None
    # Since when it has had fewer ready replicas than its step sizes it for: the step's start, or the
    # first pass that saw it fall short after it had them all (None: not short).
    short_since: float | None = None

    @property
    def active(self) -> bool:
        return self.phase in (PROGRESSING, PAUSED) and self.canary is not None


@dataclass(frozen=True)
class Facts:
    canary_ready: int  # ready canary pods
    canary_full: bool  # the canary Deployment has all the replicas it was asked for, ready
    retry_token: str | None = None  # the kiln.dev/retry-rollout annotation
    resume_token: str | None = None  # the kiln.dev/resume-rollout annotation
    unready_since: float | None = None  # the latest change of the canary pods' Ready condition (None
    # when no pod has one: a replacement pod still Pending)
    became_ready: float | None = None  # the latest turn of a canary pod's Ready condition to True
    failing: str | None = None  # a canary engine's failed exit, once it failed FAILED_STARTS times
    step_size: int = 1  # the replicas the current step sizes the canary for (desired.canary_size)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    state: State
    events: list[Event] = field(default_factory=list)

    @property
    def canary(self) -> str | None:
        return self.state.canary if self.state.active else None

    def weight(self, rollout: Rollout) -> int:
        """The canary's share of requests: 0 until it is ready, then its step's weight."""
        if not self.state.active or self.state.step == 0:
            return 0
        return rollout.steps[min(self.state.step, len(rollout.steps)) - 1].weight

    def full_size(self, rollout: Rollout) -> bool:
        """The canary is scaled to the stable revision's replicas before it is promoted."""
        return self.state.active and self.state.step > len(rollout.steps)


def advance(rollout: Rollout, previous: State | None, stable: str, target: str, facts: Facts,
            check: Check | None, now: float) -> Decision:
    """One step of the machine. `stable`: the stable revision (status), `target`: the
    revision the spec asks for now, `check`: an analysis interval that ended in this pass."""
    state = previous or State(PROMOTED, stable, message=f"{stable} serves 100%")
    # A removed annotation's token is forgotten: set again later, even to its old value, it acts,
    # as a person who set it expects (kept, the same value would do nothing, with no word why).
    state = replace(state, retry_token=state.retry_token if facts.retry_token else None,
                    resume_token=state.resume_token if facts.resume_token else None)
    retry = asked(facts.retry_token, state.retry_token)
    if state.active:
        if target == state.canary:
            return progress(rollout, state, facts, check, now)
        if target == state.stable:
            return Decision(replace(state, phase=ROLLED_BACK, canary=None, rolled_back=None, message=(
                f"the spec asks for the stable revision {state.stable} again: canary {state.canary} dropped")),
                [Event("Normal", "RolloutAborted", f"spec returned to {state.stable}; canary {state.canary} dropped")])
        if target == state.rolled_back and not retry:
            # As if the spec had never left it: rolled back, and this canary's checks are not its.
            return Decision(State(ROLLED_BACK, state.stable, rolled_back=target, retry_token=state.retry_token,
                                  resume_token=state.resume_token, message=(
                f"rolled back {target}: the spec asks for it again, which is no retry (annotate "
                f"{RETRY_ANNOTATION}); canary {state.canary} dropped; {state.stable} serves 100%")),
                [Event("Normal", "RolloutAborted", f"spec returned to rolled-back {target}; canary "
                                                   f"{state.canary} dropped")])
        return start(state, target, facts, now, f"the spec changed mid-rollout: {target} replaces canary "
                                                f"{state.canary}")
    if target == state.stable:
        # The spec no longer asks for a rolled-back revision: asked for again later, it is a new rollout.
        return Decision(replace(state, rolled_back=None))
    if state.rolled_back == target and not retry:
        return Decision(state)
    return start(state, target, facts, now, f"canary {target} starts beside stable {state.stable}")


def asked(token: str | None, seen: str | None) -> bool:
    """Whether an annotation asks for something: a value, and not the one already acted on. Its
    removal reads as None and asks for nothing (it skipped a step's gate, retried a rollback)."""
    return bool(token) and token != seen


def start(state: State, target: str, facts: Facts, now: float, why: str) -> Decision:
    # A rolled-back revision, not retried, is remembered through another revision's rollout: the
    # spec changed back to it mid-rollout leaves it rolled back (advance). Its retry token stays
    # the rollback's, so a retry asked for meanwhile still counts.
    kept = state.rolled_back if state.rolled_back != target else None
    new = State(PROGRESSING, state.stable, target, 0, now, rolled_back=kept,
                retry_token=state.retry_token if kept else facts.retry_token,
                resume_token=facts.resume_token, message=f"{why}; waiting for it to become ready")
    return Decision(new, [Event("Normal", "RolloutStarted", why)])


def progress(rollout: Rollout, state: State, facts: Facts, check: Check | None, now: float) -> Decision:
    steps, events = rollout.steps, []
    if check is not None:
        state = replace(state, analysis={"time": now, "verdict": check.verdict, **check.figures,
                                         "failed": check.failed})
        if check.verdict == FAIL:  # the step's earlier passes no longer carry it on
            state = replace(state, failed=state.failed + 1, passed=0, held=True)
            if state.failed >= max(1, rollout.analysis.failureLimit):
                return roll_back(state, facts, f"analysis failed {state.failed} time(s): {check.summary()}")
            events.append(Event("Warning", "AnalysisFailed", f"canary {state.canary}: {check.summary()} "
                                f"({state.failed}/{max(1, rollout.analysis.failureLimit)} failed checks)"))
        elif check.verdict == PASS:
            state = replace(state, passed=state.passed + 1, held=False)
    deadline = seconds(rollout.progressDeadline)
    if state.step == 0 or not facts.canary_ready:
        if facts.canary_ready:
            return next_step(rollout, state, facts, now, events)
        if facts.failing is not None:
            return failed_to_start(state, facts)
        # From step 1 on, the deadline runs from when the canary lost its last ready replica,
        # not from the step's start: a step may last longer than the deadline. That time is kept
        # from the first pass that saw it: the pods' own may be gone with them (a Pending
        # replacement has no Ready condition).
        lost = state.since
        if state.step > 0:
            lost = state.unready_since or max(state.since, min(facts.unready_since or now, now))  # skewed node clocks
            state = replace(state, unready_since=lost)
        if now - lost > deadline:
            return roll_back(state, facts, f"canary {state.canary} had no ready replica for {rollout.progressDeadline} "
                                    "(progressDeadline)")
        waiting = "to become ready" if state.step == 0 else "to have a ready replica again"
        return Decision(replace(state, message=f"waiting for canary {state.canary} {waiting}"), events)
    # A stable revision scaled up, or a canary pod evicted, long into a step leaves the canary short:
    # no stall until progressDeadline has passed from then (stalled).
    short = not facts.canary_full if state.step > len(steps) else facts.canary_ready < facts.step_size
    state = replace(state, unready_since=None, short_since=(state.short_since or now) if short else None)
    if state.step > len(steps):
        # A Fail holds promotion until a later check passes (an inconclusive one, too little data,
        # does not clear it), or a person resumes (no check comes while the routers cannot be scraped).
        held = state.held and not asked(facts.resume_token, state.resume_token)
        if facts.canary_full and not held:
            return promote(replace(state, resume_token=facts.resume_token))
        # A stable revision autoscaled up by rising load moves the size the canary must reach.
        if short and (stuck := stalled(rollout, state, facts, now, "the stable revision's size")):
            return stuck
        words = f"a failed check holds promotion (annotate {RESUME_ANNOTATION} to promote anyway)" if held \
            else f"scaling canary {state.canary} to the stable revision's size before promotion"
        return Decision(replace(state, message=f"{words}; {analysis_words(state)}"), events)
    pause = steps[state.step - 1].pause
    if pause is None:
        if asked(facts.resume_token, state.resume_token):
            return next_step(rollout, state, facts, now, events)
        return Decision(replace(state, phase=PAUSED, message=(
            f"step {state.step}/{len(steps)} paused at {steps[state.step - 1].weight}% to {state.canary}: "
            f"annotate {RESUME_ANNOTATION} to go on; {analysis_words(state)}")), events)
    # A person may go on without a passing check: too little traffic for the quality gate's
    # minTokens, say, leaves every interval inconclusive.
    if asked(facts.resume_token, state.resume_token):
        return next_step(rollout, state, facts, now, events)
    words = f"step {state.step}/{len(steps)}: {steps[state.step - 1].weight}% to {state.canary}"
    if short:
        stuck = stalled(rollout, state, facts, now, f"step {state.step}/{len(steps)}'s {facts.step_size} replicas "
                                                    f"({facts.canary_ready} ready)")
        if stuck is not None:
            return stuck
        # The router gives it a share in proportion to its ready replicas: until it has the step's,
        # the step's weight is not what is being judged, so its pause does not run yet, nor does a
        # check passed meanwhile carry the step on once it is over.
        return Decision(replace(state, phase=PROGRESSING, passed=0, message=(
            f"{words}, {facts.canary_ready}/{facts.step_size} of its replicas ready: the pause runs once they "
            f"are; {analysis_words(state)}")), events)
    # From when it had them: its last replica's turn to ready, if that came after the step began.
    started = max(state.since, facts.became_ready or 0.0)
    if state.passed > 0 and now - started >= seconds(pause):
        return next_step(rollout, state, facts, now, events)
    if now - started >= seconds(pause):
        words += (f"; the pause is over but no analysis interval has passed (annotate {RESUME_ANNOTATION} "
                  "to go on without one)")
    return Decision(replace(state, phase=PROGRESSING, message=f"{words}; {analysis_words(state)}"), events)


def next_step(rollout: Rollout, state: State, facts: Facts, now: float, events: list[Event]) -> Decision:
    # The resume annotation as it is now: one set before this step began asked to go on from an
    # earlier one, not to skip this one's gate.
    steps = rollout.steps
    step = state.step + 1
    # Short of the new step's replicas from its start until a pass sees them all ready.
    new = replace(state, phase=PROGRESSING, step=step, since=now, passed=0, held=False, short_since=now,
                  resume_token=facts.resume_token)
    if step > len(steps):
        return Decision(replace(new, message=f"every step passed: scaling canary {state.canary} up "
                                             "for promotion"),
                        events + [Event("Normal", "RolloutStep", f"canary {state.canary}: every step passed, "
                                                                  "scaling it up for promotion")])
    words = f"step {step}/{len(steps)}: {steps[step - 1].weight}% to {state.canary}"
    return Decision(replace(new, message=f"{words}; analysis starts"),
                    events + [Event("Normal", "RolloutStep", words)])


def promote(state: State) -> Decision:
    return Decision(State(PROMOTED, state.canary or state.stable, None, retry_token=state.retry_token,
                          resume_token=state.resume_token, analysis=state.analysis,
                          message=f"{state.canary} promoted to stable at 100%; {state.stable} drains and goes"))


def stalled(rollout: Rollout, state: State, facts: Facts, now: float, size: str) -> Decision | None:
    """A rollback when a canary short of `size` (its pods cannot all be placed, say) is stuck, else
    None. The deadline runs from the latest of the step's start, when it fell short and its last new
    ready replica, as a Deployment's does from its last progress: a canary still gaining replicas
    is not stuck."""
    if facts.failing is not None:  # a replica's readiness between crashes is no progress
        return failed_to_start(state, facts)
    progressed = max(state.since, state.short_since or 0.0, facts.became_ready or 0.0)
    if now - progressed > seconds(rollout.progressDeadline):
        return roll_back(state, facts, f"canary {state.canary} did not reach {size}: no replica became ready "
                                       f"for {rollout.progressDeadline} (progressDeadline)")
    return None


def failed_to_start(state: State, facts: Facts) -> Decision:
    return roll_back(state, facts, f"its engine failed to start {FAILED_STARTS} times ({facts.failing})")


def roll_back(state: State, facts: Facts, why: str) -> Decision:
    # The retry annotation as it is now: one set mid-rollout asked for no retry of this failure.
    return Decision(replace(state, phase=ROLLED_BACK, canary=None, rolled_back=state.canary,
                            retry_token=facts.retry_token,
                            message=f"rolled back {state.canary}: {why}; {state.stable} serves 100%"))


def analysis_words(state: State) -> str:
    a = state.analysis
    if not a:
        return "no analysis interval has ended yet"
    shown = ", ".join(f"{k} {a[k]}" for k in ("greedyAgreement", "noiseFloor", "errorRate", "stableErrorRate",
                                              "ttftP95Ratio", "itlP95Ratio") if a.get(k) is not None)
    return f"last analysis {a['verdict'].lower()} ({shown or 'no figures'}; {a.get('canaryRequests', 0)} " \
           f"canary requests); {state.failed} failed check(s)"


# status.rollout <-> State: RFC 3339 times in status, epoch seconds here.

def load(saved: dict[str, Any] | None) -> State | None:
    if not saved or "stable" not in saved:
        return None
    analysis = saved.get("analysis")
    if analysis and analysis.get("time"):
        analysis = {**analysis, "time": epoch(analysis["time"])}
    return State(saved["phase"], saved["stable"], saved.get("canary"), saved.get("step", 0),
                 epoch(saved.get("stepStartedAt")) or 0.0,
                 saved.get("passedChecks", 0), saved.get("failedChecks", 0),
                 saved.get("promotionHeld", False), saved.get("rolledBack"),
                 saved.get("retryToken"), saved.get("resumeToken"), analysis, saved.get("message", ""),
                 epoch(saved.get("canaryUnreadySince")), epoch(saved.get("canaryShortSince")))


def dump(state: State, rollout: Rollout | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "phase": state.phase, "stable": state.stable, "canary": state.canary, "step": state.step,
        "stepStartedAt": iso(state.since) if state.active else None, "passedChecks": state.passed,
        "failedChecks": state.failed, "promotionHeld": state.held or None, "rolledBack": state.rolled_back,
        "retryToken": state.retry_token,
        "resumeToken": state.resume_token, "message": state.message,
        "canaryUnreadySince": iso(state.unready_since) if state.active and state.unready_since else None,
        "canaryShortSince": iso(state.short_since) if state.active and state.short_since else None}
    if state.analysis:
        out["analysis"] = {**state.analysis, "time": iso(state.analysis["time"])}
    if state.active and rollout is not None and rollout.analysis.quality is not None:
        quality = rollout.analysis.quality
        out["mirror"] = {"sampleRate": quality.sampleRate, "floorSampleRate": quality.floorSampleRate}
    return {k: v for k, v in out.items() if v is not None}
