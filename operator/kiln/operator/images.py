"""Kiln's container images, named in one place: <registry>/<component>:<package version>.

The tag is the `kiln` distribution's version (pyproject.toml), so an operator always defaults
to the engine image of its own release, `make images` (kiln.local.images) tags what it builds
with the same names, and tests/test_containers.py checks that manifests/ names this operator image.
"""
from __future__ import annotations

import importlib.metadata

REGISTRY = "ghcr.io/kiln"
COMPONENTS = ("engine", "operator")


def version() -> str:
    return importlib.metadata.version("kiln")


def image(component: str) -> str:
    """The image reference of `component` ("engine" or "operator") at this package's version."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown image {component!r}; images: {', '.join(COMPONENTS)}")
    return f"{REGISTRY}/{component}:{version()}"
