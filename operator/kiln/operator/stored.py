"""The spec of a stored InferenceService as this operator reads it. A CRD newer than the operator
(applied before it in an upgrade, or kept through a `helm rollback` of the operator) gives stored
objects fields the operator's models do not know, defaults among them that nobody wrote. Refused,
they turned every service InvalidSpec and stopped all reconciling (scaling, repair, promotions)
until the operator caught up: such fields are left out, and said. Anything else wrong is refused."""
from __future__ import annotations

import copy
from typing import Any, Mapping

import pydantic

from .models import InferenceServiceSpec


def parse_spec(body: Mapping[str, Any]) -> tuple[InferenceServiceSpec, list[str]]:
    """(the spec, the paths of the fields this operator does not know, left out of it). Raises
    ValueError with pydantic's message when the spec does not fit the models otherwise."""
    spec = dict(body.get("spec") or {})
    try:
        return InferenceServiceSpec.model_validate(spec), []
    except pydantic.ValidationError as err:
        unknown = [e["loc"] for e in err.errors() if e["type"] == "extra_forbidden"]
        refused = ValueError(f"spec does not match this operator's models: {err}")
        if len(unknown) < err.error_count():
            raise refused from None
    known = copy.deepcopy(spec)
    try:
        for *path, last in unknown:
            parent: Any = known
            for step in path:
                parent = parent[step]
            del parent[last]
        return InferenceServiceSpec.model_validate(known), [".".join(map(str, loc)) for loc in unknown]
    except (KeyError, IndexError, TypeError, pydantic.ValidationError):
        raise refused from None
