"""Helpers shared by the e2e fixtures and tests (a module of its own: `conftest` is ambiguous
when tests/ and e2e/ run in one pytest session). Polling and kubectl are kiln.local.testing's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.local import testing

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Target:
    kubeconfig: Path
    cluster: Any  # kiln.local.cluster.Cluster, or None for another cluster
    kubectl_bin: str

    def kubectl(self, *args: str, check: bool = True, timeout: float = 180) -> str:
        """kubectl's stdout; a failure raises testing.KubectlError with kubectl's own message."""
        return testing.kubectl(self.kubeconfig, *args, check=check, timeout=timeout, binary=self.kubectl_bin).stdout
