"""`kiln crds`: the InferenceService CRD, generated from the pydantic models in models.py.

Pydantic writes JSON Schema; Kubernetes wants a *structural* schema (every node typed, no
$ref, nullable-free unions, no additionalProperties beside properties). `structural` turns
one into the other; everything else about the CRD is spelled out here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from .models import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec, cel
from .status_schema import InferenceServiceStatus

CRD_FILE = f"{PLURAL}.{GROUP}.yaml"
_CHECKOUT = Path(__file__).resolve().parents[3]
# A source checkout's crds/; installed from a wheel there is none, and ./crds is written instead
# (not a folder beside site-packages).
REPO_CRDS = _CHECKOUT / "crds" if (_CHECKOUT / "pyproject.toml").is_file() else Path("crds")
CHART_CRDS = REPO_CRDS.parent / "charts" / "kiln" / "crds"  # Helm's copy, byte for byte (tests/test_install.py)
NAME_RULE = cel(
    "self.metadata.name.size() <= 50 && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "metadata.name must be at most 50 lowercase letters, digits or '-', start with a letter and "
    "end with a letter or digit: it names the Service and the Deployments")
# What a user skimming `kubectl get isvc` needs; the rest is in `kubectl describe`.
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    # Why it is (not) Ready: Loading, RouterNotReady, Serving, ...
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason'},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
    # As served: spec.model.name may be left out (the source's last part then).
    {"name": "Model", "type": "string", "jsonPath": ".status.model"},
    {"name": "Source", "type": "string", "jsonPath": ".spec.model.source", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
DROPPED = {"title", "$defs"}


class Dumper(yaml.SafeDumper):
    """No &anchors: shared sub-schemas are written out in full, as kubectl users read them."""
    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(obj: Any) -> str:
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, width=100)


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one pydantic JSON Schema node (and its children) as a structural schema node."""
    node = dict(node)
    if "$ref" in node:
        node = merge(defs[node.pop("$ref").split("/")[-1]], node)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = merge(node.pop("allOf")[0], node)
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        types = {b.get("type") for b in branches}
        if types == {"string", "integer"}:
            node["x-kubernetes-int-or-string"] = True
        elif len(branches) == 1:
            node = merge(structural(branches[0], defs), node)
        else:
            raise ValueError(f"no structural form for the union {branches}")
    if node.get("default", 0) is None:
        del node["default"]
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROPPED:
            continue
        if key == "properties":
            value = {name: structural(child, defs) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = structural(value, defs)
        out[key] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` wins (a field's description beats its type's docstring); CEL rules of both stay."""
    merged = {**base, **over}
    rules = base.get("x-kubernetes-validations", []) + over.get("x-kubernetes-validations", [])
    if rules:
        merged["x-kubernetes-validations"] = rules
    return merged


def schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema()
    return structural(raw, raw.get("$defs", {}))


def build_crd() -> dict[str, Any]:
    spec = schema_of(InferenceServiceSpec)
    spec["description"] = "What to serve and how; live state is in status."
    status = schema_of(InferenceServiceStatus)
    status["description"] = "Written by the operator only."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        # Deleting the CRD deletes every InferenceService and all it runs: Helm, Argo CD and Flux
        # are told to leave it when a release or an application goes, or its file leaves Git.
        "metadata": {"name": f"{PLURAL}.{GROUP}", "annotations": {
            "helm.sh/resource-policy": "keep",
            "argocd.argoproj.io/sync-options": "Prune=false,Delete=false",
            "kustomize.toolkit.fluxcd.io/prune": "disabled"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": KIND.lower(), "shortNames": ["isvc"], "categories": ["kiln"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "An LLM served by Kiln engine replicas.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                    "x-kubernetes-validations": [NAME_RULE],
                }},
            }],
        },
    }


def render() -> dict[str, str]:
    """File name -> content of everything `kiln crds` writes."""
    header = "# Generated by `kiln crds` from operator/kiln/operator/models.py; do not edit.\n"
    crd = header + dump(build_crd())
    kustomization = header + dump({"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                   "kind": "Kustomization", "resources": [CRD_FILE]})
    return {CRD_FILE: crd, "kustomization.yaml": kustomization}


def stale_files(out_dir: Path) -> list[str]:
    return [name for name, text in render().items()
            if not (out_dir / name).exists() or (out_dir / name).read_text() != text]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, default=REPO_CRDS, help="where to write (default: crds/)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the files differ from the models")


def run(args: argparse.Namespace) -> int:
    try:
        return _check(args.out_dir) if args.check else _write(args.out_dir)
    except OSError as e:  # --out-dir is a file, under one, or not writable: one line, no traceback
        print(f"kiln crds: {e.filename or args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2


def _check(out_dir: Path) -> int:
    if not out_dir.is_dir():  # "stale: run kiln crds" would write a new folder where none was meant
        print(f"kiln crds: --out-dir {out_dir}: no such directory", file=sys.stderr)
        return 2
    stale = stale_files(out_dir)
    for name in stale:
        print(f"{out_dir / name} is stale: run `kiln crds`", file=sys.stderr)
    return 1 if stale else 0


def _write(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {out_dir / name: text for name, text in render().items()}
    if out_dir.resolve() == REPO_CRDS and CHART_CRDS.is_dir():
        written[CHART_CRDS / CRD_FILE] = render()[CRD_FILE]
    for path, text in written.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0
