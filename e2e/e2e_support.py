"""Helpers shared by the e2e fixtures and tests (a module of its own: `conftest` is ambiguous
when tests/ and e2e/ run in one pytest session). Polling and kubectl are kiln.local.testing's."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

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


@contextmanager
def local_operator(target: Target, namespace: str, log: Path, *extra: str) -> Iterator[testing.OperatorProcess]:
    """`kiln operator` for `namespace` on the local cluster, with its ServiceAccount's token and its
    pods opted into the test runtime; its log's tail printed when it stops."""
    from kiln.local import demo
    from kiln.local.kwok import EXTERNAL_READINESS

    proc = testing.OperatorProcess(demo.operator_kubeconfig(target.cluster), log,
                                   ("-n", namespace, f"--pod-annotation={EXTERNAL_READINESS}=runtime", *extra))
    proc.start(interval=5)
    try:
        yield proc
    finally:
        proc.stop()
        print(proc.tail(40))


def ready_with_its_engine_pod(target: Target, namespace: str, name: str) -> dict:
    """Wait until the InferenceService is Ready; its one engine pod."""
    target.kubectl("wait", "-n", namespace, "--for=condition=Ready", f"--timeout={LOAD_TIMEOUT}s",
                   f"inferenceservice/{name}", timeout=LOAD_TIMEOUT + 30)
    (pod,) = live_pods(target, namespace, name, "engine")
    return pod


def live_pods(target: Target, namespace: str, name: str, component: str) -> list[dict]:
    """The InferenceService's pods of one component ("engine", "router"), terminating ones left out."""
    found = json.loads(target.kubectl("get", "pods", "-n", namespace, "-o", "json", "-l",
                                      f"kiln.dev/inferenceservice={name},kiln.dev/component={component}"))
    return [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


class Threads:
    """Background threads (load clients, watchers, fault injectors), each running `_run(i)` until
    `stop` is set: started on entering the block, stopped and joined on leaving it."""

    def __init__(self, count: int = 1) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(count)]

    def _run(self, i: int) -> None:
        raise NotImplementedError

    def __enter__(self) -> Threads:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


class Load(Threads):
    """Clients streaming long completions in a loop until stopped; every outcome is kept."""

    def __init__(self, url: str, clients: int, max_tokens: int = 64) -> None:
        self.max_tokens = max_tokens
        self.api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        self.failures: list[str] = []
        self.done = 0
        super().__init__(clients)

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            try:
                stream = self.api.completions.create(model=MODEL, prompt=f"Story {i}.{self.done}: once upon a time",
                                                     max_tokens=self.max_tokens, stream=True)
                finish = [c.choices[0].finish_reason for c in stream][-1]
                if finish not in ("length", "stop"):
                    self.failures.append(f"finish_reason={finish}")
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - any failure is what this test counts
                self.failures.append(repr(exc))
