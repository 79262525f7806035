"""Helpers shared by the e2e fixtures and tests (a module of its own: `conftest` is ambiguous
when tests/ and e2e/ run in one pytest session). Polling and kubectl are kiln.local.testing's."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.local import testing

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
LOAD_TIMEOUT = 900  # engines load and warm up on a busy CPU
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Target:
    kubeconfig: Path
    cluster: Any  # kiln.local.cluster.Cluster, or None for another cluster
    kubectl_bin: str

    def kubectl(self, *args: str, check: bool = True, timeout: float = 180, input: str | None = None) -> str:
        """kubectl's stdout; a failure raises testing.KubectlError with kubectl's own message."""
        return testing.kubectl(self.kubeconfig, *args, check=check, timeout=timeout, input=input,
                               binary=self.kubectl_bin).stdout
