"""The InferenceService API as pydantic models: the one source of truth for the CRD schema
(crds.py generates it, CEL rules included) and for how the operator reads a spec."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

GROUP = "kiln.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"


def cel(rule: str, message: str) -> dict[str, Any]:
    """One x-kubernetes-validations entry; the API server checks it, the message is what users see."""
    return {"rule": rule, "message": message}


def rules(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(entries)}


# Same grammar as Kubernetes resource quantities (1, 500m, 16Gi, 1e3), as a regex because the
# CEL quantity library is missing on older API servers. int-or-string so `cpu: 4` works too; a
# negative count is no amount of a resource (a pod asking for it is refused).
# An exponent of two digits at most: 1e999999 is 8 characters, and turning it into an integer
# held the operator's every thread (and its Lease) for half a minute.
QUANTITY_RE = r"^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][-+]?[0-9]{1,2}|[mkMGTPE]|[KMGTPE]i)?$"
QUANTITY_MESSAGE = "must be a Kubernetes quantity such as 4, 500m, 512Mi or 16Gi"
QUANTITY_MAX = 2**63 - 1  # Kubernetes' largest quantity


def check_quantity(value: str | int) -> str | int:
    """The CEL rule below, also applied by the operator: a spec stored under an older CRD must
    become InvalidSpec, not a crash when the quantity is converted."""
    if (isinstance(value, int) and value < 0) or (isinstance(value, str) and not re.match(QUANTITY_RE, value)):
        raise ValueError(QUANTITY_MESSAGE)
    if parse_quantity(value) > QUANTITY_MAX:  # a Decimal: compared without becoming a huge integer
        raise ValueError(f"must be at most 2^63-1 (Kubernetes' largest quantity), got {value!r}")
    return value


Quantity = Annotated[
    str | int,
    AfterValidator(check_quantity),
    Field(json_schema_extra={"maxLength": 64, **rules(cel(
        f"type(self) == int ? self >= 0 : self.matches('{QUANTITY_RE}')", QUANTITY_MESSAGE))}),
]
def matching(pattern: str, message: str, max_length: int, refused: str | None = None) -> Any:
    """A string the API server checks by regex (CEL's RE2: `pattern` must match, `refused` must
    not be found) and the operator checks again: a spec stored under an older CRD, or kept through
    CRD validation ratcheting, must become InvalidSpec, not a crash or an object never meant (a
    model source of hostpath://// mounting the node's root)."""
    def check(value: str) -> str:
        if not re.search(pattern, value) or (refused and re.search(refused, value)):
            raise ValueError(message)
        return value
    rule = f"self.matches('{pattern}')" + (f" && !self.matches('{refused}')" if refused else "")
    return Annotated[str, AfterValidator(check), Field(max_length=max_length, json_schema_extra=rules(cel(rule, message)))]


def seconds(duration: str) -> float:
    """'1h30m', '90s', '500ms' -> seconds (the Duration grammar below)."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))


# Go-style durations limited to what a person writes: 500ms, 30s, 5m, 1h, 1h30m.
Duration = matching("^([0-9]+(ms|s|m|h))+$", "must be a duration such as 30s, 5m or 1h (units: ms, s, m, h)", 32)
# No `..` segment: Kubernetes refuses such a hostPath, and a claim's path must stay in the claim.
CLAIM = "pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^/].*)?"
PARENT = "(^|/)[.][.](/|$)"
ModelSource = matching(f"^(builtin://[a-z0-9][a-z0-9._-]*|{CLAIM}|hostpath:///[^/].*)$",
                       "must be builtin://<name>, pvc://<claim>/<path> or hostpath:///<absolute path>, "
                       "without a .. segment", 512, PARENT)
AdapterSource = matching(f"^({CLAIM}|hostpath:///[^/].*)$",
                         "must be pvc://<claim>/<path> or hostpath:///<absolute path>, without a .. segment",
                         512, PARENT)
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]


def unique_names(items: list[Any]) -> list[Any]:
    """The CRD's list-map refuses two entries of one name; this holds a spec stored under an
    older CRD to the same rule."""
    names = [item.name for item in items]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"{', '.join(twice)}: named more than once")
    return items


# A list of entries keyed by `name`, as Kubernetes keeps env and imagePullSecrets.
BY_NAME = (AfterValidator(unique_names),
           Field(json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}))


class Spec(BaseModel):
    """Base for spec blocks: unknown fields are errors, never silently dropped."""
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Spec):
    """Which weights to serve and under what name."""

    name: str | None = Field(None, max_length=128, description=(
        "The name clients send as the OpenAI `model`; defaults to the last part of the source."))
    source: ModelSource = Field(description=(
        "builtin://<name>, pvc://<claim>/<path> (HF folder or .gguf) or hostpath:///<absolute path>."))

    @property
    def served_name(self) -> str:
        """name, or the source's last part (a .gguf without its suffix)."""
        if self.name:
            return self.name
        last = self.source.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1]
        return last.removesuffix(".gguf")


class KVCache(Spec):
    memory: Quantity | None = Field(None, description=(
        "Memory for the paged KV cache per replica (per rank with tensor parallelism). Unset: on GPUs what "
        "90% of the GPU's memory leaves after the weights and a full step's activations (the engine's "
        "gpu_memory_utilization), on CPUs and under tensor parallelism 1Gi."))
    prefixCaching: bool = True
    dtype: Literal["auto", "int8", "fp8"] = Field(
        "auto", description="KV cache element type: auto (the model dtype), int8 or fp8 (half a 16-bit "
                            "cache: about twice the sequences in the same memory).")

    @field_validator("memory")
    @classmethod
    def _some_bytes(cls, memory: str | int | None) -> str | int | None:
        # A valid quantity may still round to no bytes (0, 500m, 1e-3): the engine would refuse it
        # and its pods crash-loop; refused here, the spec's status says why.
        if memory is not None and int(parse_quantity(memory)) < 1:
            raise ValueError(f"must be at least one byte, got {memory!r}")
        return memory


class Speculative(Spec):
    """Speculative decoding, numTokens drafts a step: ngram (prompt lookup) or draft (a smaller
    model with the target's vocabulary guesses them; with tensor parallelism it runs whole on rank 0)."""
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "self.method != 'draft' || has(self.model)",
        "speculative.method draft needs speculative.model (the draft model)")))
    method: Literal["ngram", "draft"]
    numTokens: int = Field(4, ge=1, le=16)
    # No drafts while more requests than this run in a replica (a busy batch gains nothing).
    disableByBatchSize: int | None = Field(None, ge=1)
    model: ModelSpec | None = None


class Adapter(Spec):
    """A LoRA adapter (a PEFT folder: adapter_config.json, adapter_model.safetensors) that the engines
    serve beside the model, under its own name."""
    name: str = Field(max_length=128, pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*$", description=(
        "The name clients send as the OpenAI `model` to run with this adapter."))
    source: AdapterSource = Field(description="pvc://<claim>/<path> or hostpath:///<absolute path>.")


# Kubernetes refuses these names for env variables and Secret/ConfigMap keys.
NOT_DOTS = rules(cel("self != '.' && !self.startsWith('..')", "must not be '.' or start with '..'"))
# Kubernetes' own grammars, so a bad value is refused with the InferenceService, not by every
# Deployment the operator applies: an object's name (DNS subdomain), a Secret or ConfigMap key,
# a label key (taint keys too) and a label value.
OBJECT_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DATA_KEY = r"^[-._a-zA-Z0-9]+$"
# (a toleration's empty key, with Exists, tolerates every taint)
# (the name after the prefix at most 63 characters: a longer one passed, and every Deployment was refused)
LABEL_KEY = r"^(([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# Kubernetes' grammar of a label or annotation key (apimachinery's validation), with its lengths: an
# optional DNS subdomain prefix and a name. The CRD leaves map keys to the operator: a rule there
# over every key would pass the API server's cost budget for CEL.
NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
QUALIFIED_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{NAME}$")


class KeySelector(Spec):
    name: str = Field(max_length=253, pattern=OBJECT_NAME)
    key: str = Field(max_length=253, pattern=DATA_KEY, json_schema_extra=NOT_DOTS)
    optional: bool = False


class EnvSource(Spec):
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "has(self.secretKeyRef) != has(self.configMapKeyRef)",
        "valueFrom takes exactly one of secretKeyRef and configMapKeyRef")))
    secretKeyRef: KeySelector | None = None
    configMapKeyRef: KeySelector | None = None


class EnvVar(Spec):
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "!(has(self.value) && has(self.valueFrom))", "an env entry takes value or valueFrom, not both")))
    name: str = Field(max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", json_schema_extra=NOT_DOTS)
    value: str | None = Field(None, max_length=32768)
    valueFrom: EnvSource | None = None

    @field_validator("value")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        return value or None  # as the API server stores it (it drops an empty value), or plans never end


MAX_ARGUMENT_BYTES = 131071  # Linux's MAX_ARG_STRLEN (32 pages of 4 KiB) less the NUL


class Engine(Spec):
    """Engine settings; any change here (or to the model) makes a new revision."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    maxModelLen: int | None = Field(None, ge=16, le=1 << 20)
    maxNumSeqs: int = Field(128, ge=1, le=4096)
    tensorParallelSize: int = Field(1, ge=1, le=64, description="Must equal resources.gpus on GPUs.")
    quantization: Literal["none", "int8", "int4", "int4-rtn", "fp8"] = Field(
        "none", description="Weight-only quantization at load: int8 per channel, int4 group-wise, fp8 e4m3 "
                            "per channel, each with activation-aware scaling (int4-rtn: plain rounding).")
    kvCache: KVCache = Field(default_factory=KVCache, json_schema_extra={"default": {}})
    speculative: Speculative | None = None
    toolCallParser: Literal["none", "hermes", "llama3_json", "mistral", "pythonic"] = Field("none", description=(
        'How the model writes a tool call, which tool_choice "auto" (the default with tools) needs: '
        "hermes (Qwen2.5, Hermes), llama3_json (Llama 3.1+), mistral or pythonic (Llama 3.2, 4). "
        "With none, requests with tools must name tool_choice."))  # kiln.engine.tool_parsers.PARSERS
    chatTemplate: str | None = Field(None, min_length=1, max_length=65536, description=(
        "A Jinja chat template replacing the model's (kiln serve --chat-template), for a model that has "
        "none or a different one; an engine whose template does not compile exits at start."))
    env: Annotated[list[EnvVar], *BY_NAME] = Field(default_factory=list, max_length=64, description=(
        "Environment variables of the engine container (e.g. NCCL or OpenMP settings); one named "
        "here replaces Kiln's own of that name."))
    adapters: Annotated[list[Adapter], *BY_NAME] = Field(default_factory=list, max_length=32, description=(
        "LoRA adapters served beside the model, each under its name."))
    maxLoras: int = Field(1, ge=1, le=64, description=(
        "Distinct adapters one batch may mix; requests of other adapters wait for a seat."))
    maxLoraRank: int = Field(16, ge=1, le=512, description="The largest rank an adapter may have.")

    @property
    def draft_model(self) -> ModelSpec | None:
        """The draft model the engines speculate with, if any."""
        spec = self.speculative
        return spec.model if spec is not None and spec.method == "draft" else None

    @field_validator("chatTemplate")
    @classmethod
    def _one_argument(cls, template: str | None) -> str | None:
        # It goes to the engine as one argument, which Linux caps at 128 KiB (MAX_ARG_STRLEN): one
        # longer in UTF-8 and the container could never start (E2BIG). Its backslashes go doubled
        # (engine_command.template_argument).
        size = len(template.encode()) + template.count("\\") if template is not None else 0
        if size > MAX_ARGUMENT_BYTES:
            raise ValueError(f"chatTemplate is {size} bytes in UTF-8 as the engine's argument (a backslash "
                             f"counts twice); the engine takes it as one, at most {MAX_ARGUMENT_BYTES}")
        return template


class Toleration(Spec):
    # Kubernetes' own rules for a pod's tolerations, checked here so that a bad one is refused
    # with the InferenceService instead of by every engine Deployment the operator applies.
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "self.operator != 'Exists' || !has(self.value)",
        "a toleration with operator Exists must not set value"), cel(
        "self.operator == 'Exists' || (has(self.key) && self.key != '')",
        "a toleration without key must have operator Exists (it then tolerates every taint)"), cel(
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "a toleration with tolerationSeconds must have effect NoExecute"), cel(
        # LABEL_KEY checks the prefix's form, not its length (a regex cannot do both).
        "!has(self.key) || self.key.matches('^([^/]{1,253}/)?[^/]*$')",
        "a toleration key's prefix (before the /) is at most 253 characters")))
    key: str | None = Field(None, max_length=317, pattern=LABEL_KEY)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63, pattern=LABEL_VALUE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None

    @field_validator("key")
    @classmethod
    def _prefix_length(cls, key: str | None) -> str | None:
        if key is not None and "/" in key and len(key.split("/")[0]) > 253:
            raise ValueError("a toleration key's prefix (before the /) is at most 253 characters")
        return key


class Resources(Spec):
    """What one replica gets."""
    gpus: int = Field(0, ge=0, le=64, description="nvidia.com/gpu per replica; 0 runs on CPU.")
    cpu: Quantity = "1"
    memory: Quantity = "4Gi"
    nodeSelector: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)

    @field_validator("nodeSelector")
    @classmethod
    def _label_keys(cls, selector: dict[str, str]) -> dict[str, str]:
        # Else every engine Deployment the operator applies is refused, and no revision is made.
        bad = [key for key in selector if not QUALIFIED_KEY.match(key)]
        if bad:
            raise ValueError(f"resources.nodeSelector: {bad[0]!r} is not a label key ([prefix/]name: a name of "
                             "at most 63 letters, digits, '-', '_' or '.', beginning and ending with a letter or digit)")
        return selector


ACTIVATION_MESSAGE = "autoscaling.activationTimeout must be at least 1s"


class Autoscaling(Spec):
    """Scaling on queue depth: `builtin` (the operator's own autoscaler), `hpa`, `keda`, or `none`."""
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "self.minReplicas <= self.maxReplicas",
        "autoscaling.minReplicas must not be greater than autoscaling.maxReplicas"), cel(
        # The HPA's scale-down stabilization window is what carries it there (KEDA's HPA too); the
        # API server refuses an HPA whose window is longer than an hour.
        "!(self.mode in ['hpa', 'keda']) || duration(self.scaleDownDelay) <= duration('1h')",
        "autoscaling.scaleDownDelay must be at most 1h with mode hpa or keda (an HPA's longest scale-down "
        "window)"), cel(
        # Knative's bounds: a shorter stable window follows each sample's noise, and a panic
        # window longer than the stable one would be the slower of the two.
        "duration(self.stableWindow) >= duration('6s')",
        "autoscaling.stableWindow must be at least 6s"), cel(
        "duration(self.panicWindow) >= duration('1s') && duration(self.panicWindow) <= duration(self.stableWindow)",
        "autoscaling.panicWindow must be at least 1s and not longer than autoscaling.stableWindow"), cel(
        "!has(self.activationTimeout) || duration(self.activationTimeout) >= duration('1s')", ACTIVATION_MESSAGE)))
    mode: Literal["builtin", "hpa", "keda", "none"] = "builtin"
    minReplicas: int = Field(1, ge=0, le=1000)
    maxReplicas: int = Field(4, ge=1, le=1000)
    targetQueueDepth: int = Field(4, ge=1, description=(
        "Requests per replica, waiting + running (every mode; keda adds the requests the router holds)."))
    stableWindow: Duration = "60s"
    panicWindow: Duration = "6s"
    scaleDownDelay: Duration = "5m"
    activationTimeout: Duration | None = Field(None, description=(
        "How long the router holds a request while no replica is ready (at zero, or all still loading), "
        "then answers 503; longer than a replica takes to start and load its model (default 5m)."))

    @model_validator(mode="after")
    def _bounds_in_order(self) -> Autoscaling:
        # Also when the CEL rule did not see the object (stored before it, or a CRD without it):
        # the builtin autoscaler ran minReplicas, above maxReplicas, where an HPA runs the max.
        if self.minReplicas > self.maxReplicas:
            raise ValueError("autoscaling.minReplicas must not be greater than autoscaling.maxReplicas")
        if self.activationTimeout is not None and seconds(self.activationTimeout) < 1:
            raise ValueError(ACTIVATION_MESSAGE)  # the router refuses to start on it: a crash loop
        return self

    @property
    def floor(self) -> int:
        """The fewest replicas it serves with: an HPA's minReplicas is at least 1 (one whose target
        is at zero stops acting; scaling to zero is an alpha feature gate)."""
        return max(1, self.minReplicas) if self.mode == "hpa" else self.minReplicas


class WarmPool(Spec):
    """Replicas of the stable revision loaded and warmed but not routed, beyond those that serve;
    promoted to serving (a label change, no restart) when more are wanted, then refilled."""
    size: int = Field(0, ge=0, le=100)
    # Off by default, as vLLM's sleep mode is: a pod holding its GPUs alone frees memory nothing else
    # can use, and the wake (CUDA graphs captured anew) can outlast the operator's 1 s wait at promotion.
    sleep: bool = Field(False, description="Standbys release their KV cache while they wait (the engine's "
                        "POST /sleep) and are woken just before promotion. Only worth it where others "
                        "use the memory (shared GPUs): on a GPU the wake captures the CUDA graphs anew, "
                        "and a promotion's first requests wait for it.")


class RolloutStep(Spec):
    weight: int = Field(ge=1, le=100, description="Percent of traffic to the new revision.")
    pause: Duration | None = None


class Quality(Spec):
    """The quality gate: the router mirrors a share of requests, has the stable revision answer
    them greedily and the canary score those tokens (teacher-forced greedy agreement)."""
    sampleRate: Ratio = Field(0.05, description="Share of requests mirrored for the quality gate.")
    minGreedyAgreement: Ratio = Field(0.9, description=(
        "Canary agreement with stable's greedy tokens, as a share of the noise floor (stable scoring "
        "its own tokens on another replica)."))
    minTokens: int = Field(64, ge=1, le=1_000_000, description=(
        "Mirrored tokens an interval needs before agreement counts; fewer: inconclusive."))
    floorSampleRate: Ratio = Field(0.25, description=(
        "Share of mirrored requests also scored by a stable replica, for the noise floor."))


class Analysis(Spec):
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "!has(self.interval) || duration(self.interval) >= duration('1s')", "rollout.analysis.interval must be at least 1s")))
    interval: Duration = "1m"
    failureLimit: int = Field(2, ge=0, le=100, description=(
        "Failed checks that roll the canary back (0 and 1 both: the first)."))
    minRequests: int = Field(10, ge=1, le=1_000_000, description=(
        "Canary requests an interval needs before its error rate and quality are judged; fewer: inconclusive, "
        "unless a latency ratio fails (judged on minRequests streams each side, answered or not)."))
    maxErrorRate: Ratio = Field(0.01, description=(
        "How far the canary's 5xx share may exceed the stable revision's over an interval; the stable's "
        "counts when it answered at least minRequests, else 0 (the threshold is then absolute)."))
    maxTimeToFirstTokenP95Ratio: float = Field(1.25, ge=1.0, description="canary / stable, at least 1")
    maxInterTokenLatencyP95Ratio: float = Field(1.25, ge=1.0, description="canary / stable, at least 1")
    quality: Quality | None = None


class Rollout(Spec):
    """Canary steps for a new revision: each step sends `weight` percent of requests to it for
    `pause` (no pause: hold until the kiln.dev/resume-rollout annotation changes), analysed
    against the stable revision every interval; then promotion, or a rollback on failures."""
    model_config = ConfigDict(json_schema_extra=rules(cel(
        "!has(self.progressDeadline) || duration(self.progressDeadline) >= duration('1s')",
        "rollout.progressDeadline must be at least 1s (0s would roll back every canary)")))
    steps: list[RolloutStep] = Field(min_length=1, max_length=20, json_schema_extra=rules(cel(
        "self.map(s, s.weight).isSorted() && self.all(a, self.exists_one(b, b.weight == a.weight))",
        "rollout.steps weights must be strictly increasing")))
    analysis: Analysis = Field(default_factory=Analysis, json_schema_extra={"default": {}})
    progressDeadline: Duration = Field("10m", description=(
        "How long the canary may take to become ready (and stay without a ready replica, and go "
        "without a new ready replica while it scales to the stable revision's size before "
        "promotion) before it is rolled back."))


class SecretKeyRef(Spec):
    name: str = Field(max_length=253, pattern=OBJECT_NAME, description="A Secret in the InferenceService's namespace.")
    key: str = Field("api-keys", max_length=253, pattern=DATA_KEY, json_schema_extra=NOT_DOTS, description=(
        "Its key holding the API keys: one whole key a line (one per tenant); '#' at the start of a "
        "line or after a space starts a comment."))


class Auth(Spec):
    """Who may use the model: the router demands `Authorization: Bearer <key>` on every path but
    its probes, /metrics and /openapi.json, and salts each key's prefix cache apart from the others'."""
    apiKeySecretRef: SecretKeyRef


class LocalObjectReference(Spec):
    name: str = Field(max_length=253, pattern=OBJECT_NAME, description="A Secret in the InferenceService's namespace.")


class RouterSpec(Spec):
    """The router in front of the engines: more than one replica survives losing one (a
    PodDisruptionBudget keeps one up through voluntary disruptions)."""
    replicas: int = Field(1, ge=1, le=20)


ADAPTER_IS_MODEL = "an engine.adapters name is the model's own name: requests could not tell them apart"
# ModelSpec.served_name in CEL, for the API server to refuse what the operator would: the name if
# not empty, else the source's last part (trailing slashes dropped), a .gguf without its suffix.
_LAST = "self.model.source.find('[^/]+/*$').find('^[^/]+')"
SERVED_NAME_CEL = (f"((has(self.model.name) && self.model.name != '') ? self.model.name : "
                   f"({_LAST}.endsWith('.gguf') ? {_LAST}.substring(0, size({_LAST}) - 5) : {_LAST}))")


class InferenceServiceSpec(Spec):
    model_config = ConfigDict(json_schema_extra=rules(cel(
        # One GPU per rank and no data parallelism: GPUs past the ranks would sit idle, paid for.
        "self.resources.gpus == 0 || self.resources.gpus == self.engine.tensorParallelSize",
        "resources.gpus must equal engine.tensorParallelSize (one GPU per rank; more would sit idle)"), cel(
        "self.engine.tensorParallelSize == 1 || self.resources.gpus >= self.engine.tensorParallelSize",
        "engine.tensorParallelSize is larger than resources.gpus: a tensor-parallel rank needs a GPU of its own"), cel(
        f"!has(self.engine.adapters) || !self.engine.adapters.exists(a, a.name == {SERVED_NAME_CEL})",
        ADAPTER_IS_MODEL)))
    model: ModelSpec
    replicas: int = Field(1, ge=0, le=1000, description=(
        "Replicas when autoscaling is off; what /scale (HPA, KEDA, kubectl scale) sets."))
    engine: Engine = Field(default_factory=Engine, json_schema_extra={"default": {}})
    resources: Resources = Field(default_factory=Resources, json_schema_extra={"default": {}})
    autoscaling: Autoscaling | None = None
    warmPool: WarmPool | None = None
    rollout: Rollout | None = None
    auth: Auth | None = None
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    imagePullSecrets: Annotated[list[LocalObjectReference], *BY_NAME] = Field(
        default_factory=list, max_length=16, description=(
            "Registry credentials (kubernetes.io/dockerconfigjson Secrets) for the engine and router "
            "pods, when the engine image is in a private registry; changing them restarts the pods."))

    @model_validator(mode="after")
    def _adapters_named_apart_from_the_model(self) -> InferenceServiceSpec:
        if any(adapter.name == self.model.served_name for adapter in self.engine.adapters):
            raise ValueError(ADAPTER_IS_MODEL)
        return self

    @model_validator(mode="after")
    def _sources_mounted_apart(self) -> InferenceServiceSpec:
        """Refuses sources the engine pod would read through one another's volume (a host folder
        at a claim's or the engine's own mount path): InvalidSpec, not a Deployment the API server
        refuses or an engine serving the wrong weights."""
        from .engine_command import model_volumes  # where sources mount is its to say; it imports this module
        model_volumes(self)
        return self
