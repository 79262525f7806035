"""Cluster-wide placement defaults for engine pods, set by whoever installs the operator
(manifests/overlays/{cpu,gpu}, the Helm chart's `engine.gpu` and `engine.cpu`) rather than in every
InferenceService: where GPU engines go (node labels, the taints GPU node pools carry) and where
CPU engines go (and the router pods: the engine image, on the CPU). An InferenceService's own
nodeSelector and tolerations are kept and win."""
from __future__ import annotations

import re

from dataclasses import dataclass, field

from .models import NAME, QUALIFIED_KEY, InferenceServiceSpec, Toleration

EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()


@dataclass(frozen=True)
class Placements:
    gpu: Placement = Placement()  # engines with resources.gpus > 0
    cpu: Placement = Placement()  # engines with resources.gpus == 0


LABEL_VALUE = re.compile(rf"^{NAME}?$")  # a label value is a name or empty


def check_key(key: str, flag: str) -> str:
    """A label or annotation key; raises ValueError naming the flag, as the API server would
    refuse every object carrying it."""
    if not QUALIFIED_KEY.match(key):
        raise ValueError(f"{flag}: {key!r} is not a Kubernetes key ([prefix/]name: a name of at most 63 "
                         "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit)")
    return key


def parse_label(text: str, flag: str) -> tuple[str, str]:
    """KEY=VALUE; raises ValueError naming the flag."""
    key, sep, value = text.partition("=")
    if not key or not sep:
        raise ValueError(f"{flag} takes KEY=VALUE, got {text!r}")
    if not LABEL_VALUE.match(value):
        raise ValueError(f"{flag}: {value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
                         "beginning and ending with a letter or digit)")
    return check_key(key, flag), value


def parse_toleration(text: str, flag: str) -> Toleration:
    """KEY[=VALUE][:EFFECT]: tolerate the taint KEY (any value unless VALUE is given)."""
    taint, _, effect = text.partition(":")
    key, sep, value = taint.partition("=")
    if not key or (effect and effect not in EFFECTS):
        raise ValueError(f"{flag} takes KEY[=VALUE][:EFFECT] with EFFECT one of {', '.join(EFFECTS)}, got {text!r}")
    check_key(key, flag)
    if sep and not LABEL_VALUE.match(value):
        raise ValueError(f"{flag}: {value!r} is not a taint value (at most 63 letters, digits, '-', '_' or '.')")
    return Toleration(key=key, operator="Equal" if sep else "Exists", value=value if sep else None,
                      effect=effect or None)


def placed(spec: InferenceServiceSpec, placements: Placements) -> InferenceServiceSpec:
    """The spec with the defaults for its kind of engine merged under its own choices."""
    default = placements.gpu if spec.resources.gpus > 0 else placements.cpu
    if not default.node_selector and not default.tolerations:
        return spec
    own = spec.resources
    tolerations = [*own.tolerations, *(t for t in default.tolerations if t not in own.tolerations)]
    resources = own.model_copy(update={"nodeSelector": {**default.node_selector, **own.nodeSelector},
                                       "tolerations": tolerations})
    return spec.model_copy(update={"resources": resources})
