"""The InferenceService status as pydantic models: the CRD's status schema (crds.py generates it).
status.py computes the values; these say their names, types and meaning."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Condition(BaseModel):
    type: str = Field(max_length=64)
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    lastTransitionTime: str | None = Field(None, json_schema_extra={"format": "date-time"})
    observedGeneration: int | None = None


class RevisionStatus(BaseModel):
    name: str
    role: Literal["stable", "canary", "old"]
    quantization: str
    replicas: int = Field(0, description="Replicas that serve (a warm pool's standbys are not counted).")
    ready: int = Field(0, description="Of those, ready.")
    weight: int | None = Field(None, description=(
        "Percent of requests the router sends here during a rollout; absent: no split."))


class AnalysisStatus(BaseModel):
    """The last interval's figures, canary against stable, as the routers measured them."""
    time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    verdict: Literal["Pass", "Fail", "Inconclusive"] | None = None
    canaryRequests: int | None = None
    stableRequests: int | None = None
    errorRate: float | None = None
    stableErrorRate: float | None = Field(None, description=(
        "The stable revision's 5xx share, which the canary's may exceed by maxErrorRate; absent: stable "
        "answered fewer than minRequests, and maxErrorRate is absolute."))
    ttftP95Ratio: float | None = None
    itlP95Ratio: float | None = None
    greedyAgreement: float | None = None
    agreementTokens: int | None = None
    noiseFloor: float | None = None
    noiseFloorTokens: int | None = None
    failed: list[str] = Field(default_factory=list)


class MirrorStatus(BaseModel):
    """What the routers mirror for the quality gate (they read it here, never in spec)."""
    sampleRate: float
    floorSampleRate: float


class RolloutStatus(BaseModel):
    """The rollout's state: all an operator restart needs to resume the same step."""
    phase: Literal["Progressing", "Paused", "Promoted", "RolledBack"]
    stable: str
    canary: str | None = None
    step: int = Field(0, description="1-based step in progress; 0: waiting for the canary to be ready; "
                                     "len(steps)+1: scaling the canary up before promotion.")
    stepStartedAt: str | None = Field(None, json_schema_extra={"format": "date-time"})
    canaryUnreadySince: str | None = Field(
        None, json_schema_extra={"format": "date-time"},
        description="From step 1 on: since when the canary has had no ready replica (progressDeadline runs from it).")
    canaryShortSince: str | None = Field(
        None, json_schema_extra={"format": "date-time"},
        description="From step 1 on: since when the canary has had fewer ready replicas than its step sizes it for "
                    "(progressDeadline runs from it, or from a replica that became ready later).")
    passedChecks: int = 0
    failedChecks: int = 0
    promotionHeld: bool | None = Field(None, description="A check failed in this step and none has passed since: "
                                                         "the canary is not promoted (kiln.dev/resume-rollout "
                                                         "overrides).")
    rolledBack: str | None = Field(None, description="A revision rolled back; not retried while the spec "
                                                     "still asks for it, unless kiln.dev/retry-rollout changes.")
    retryToken: str | None = None
    resumeToken: str | None = None
    mirror: MirrorStatus | None = None
    analysis: AnalysisStatus | None = None
    message: str = ""


class ScaleDownAsk(BaseModel):
    replicas: int
    time: str = Field(json_schema_extra={"format": "date-time"}, description="When demand last asked for them.")


class AutoscalingStatus(BaseModel):
    """The builtin autoscaler's last decision and the state it needs after an operator restart."""
    replicas: int = Field(0, description="Replicas the autoscaler decided for the serving revision.")
    mode: Literal["stable", "panic"] = "stable"
    load: float | None = Field(None, description="Waiting + running requests (stable-window average), "
                                                 "held requests included; while the decision holds, brought "
                                                 "up to date every 15 s.")
    loadTime: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                 description="When load (and the ScalingReady message) was written.")
    panicUntil: str | None = Field(None, json_schema_extra={"format": "date-time"})
    scaleDownSince: str | None = Field(None, json_schema_extra={"format": "date-time"},
                                       description="Since when demand is lower (the scale-down delay runs).")
    scaleDownAsks: list[ScaleDownAsk] | None = Field(
        None, description="The last scaleDownDelay's asks below replicas, each with when it was last made (the "
                          "last, still asked, with when it was first made), as a running maximum (asks "
                          "decreasing): a scale-down goes to the first.")
    lastScaleTime: str | None = Field(None, json_schema_extra={"format": "date-time"})
    lastColdStartSeconds: float | None = Field(None, description="Request held at zero replicas -> first byte.")


class WarmPoolStatus(BaseModel):
    """The stable revision's warm pool, and what it costs."""
    size: int = 0
    ready: int = Field(0, description="Standby replicas loaded, warm and not routed.")
    promotions: int = 0
    lastPromotion: str | None = Field(None, json_schema_extra={"format": "date-time"})
    idleReplicaSeconds: float = Field(0.0, description="Replica-seconds spent ready in the pool.")
    idleGPUSeconds: float = Field(0.0, description="GPU-seconds spent ready in the pool.")
    accountedAt: str | None = Field(None, json_schema_extra={"format": "date-time"})


class InferenceServiceStatus(BaseModel):
    observedGeneration: int | None = None
    url: str | None = None
    model: str | None = Field(None, description="The name the model answers to in requests (spec.model.name, "
                              "or the source's last part).")
    replicas: int = Field(0, description="Replicas that serve, all revisions (standbys: warmReplicas).")
    readyReplicas: int = Field(0, description="Of those, ready.")
    desiredReplicas: int = 0
    selector: str | None = Field(None, description="Label selector of the engine pods (for /scale).")
    revisions: list[RevisionStatus] = Field(default_factory=list)
    autoscaling: AutoscalingStatus | None = None
    rollout: RolloutStatus | None = None
    warmReplicas: int | None = None
    warmPool: WarmPoolStatus | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
