"""Helpers shared by the e2e fixtures and tests (a module of its own: `conftest` is ambiguous
when tests/ and e2e/ run in one pytest session)."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Target:
    kubeconfig: Path
    cluster: Any  # kiln.local.cluster.Cluster, or None for another cluster
    kubectl_bin: str

    def kubectl(self, *args: str, check: bool = True, timeout: float = 180) -> str:
        done = subprocess.run([self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
        return done.stdout


def eventually(check: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    """Poll until check() is truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (AssertionError, OSError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last seen: {last!r}")
