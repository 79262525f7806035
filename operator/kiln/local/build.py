"""Build the control-plane binaries from the Go module proxy, once per version.

Four Go modules live in gobuild/: `kube` (kube-apiserver, kube-controller-manager,
kube-scheduler, kubectl and etcd at the version Kubernetes pins), `kwok`, `kube-score` (the
linter tests/test_lint.py runs) and `helm` (tests/test_install.py renders charts/kiln). Binaries land
in ~/.cache/kiln/<module>-<version>/bin; a folder that exists is complete, because builds
go to a temporary folder that is renamed only after every binary linked.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

KUBE_VERSION = "v1.37.1"
# The release's commit and tag time, as the module proxy's v1.37.1.info reports them.
KUBE_COMMIT, KUBE_DATE = "f78e722310e50bcaca9276be22276d9e91d91308", "2026-09-23T17:06:22Z"
KWOK_VERSION = "v0.8.0"
KUBE_SCORE_VERSION = "v1.20.0"  # the linter the security tests run (tests/test_lint.py)
HELM_VERSION = "v3.22.0"  # lints and renders charts/kiln (tests/test_install.py)
GOBUILD = Path(__file__).parent / "gobuild"
# The version variables Kubernetes' own release build sets (hack/lib/version.sh); without
# them the apiserver reports v0.0.0-master and kubectl/clients refuse skew checks.
VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")


@dataclass(frozen=True)
class Target:
    module: str  # folder under gobuild/
    version: str
    packages: tuple[str, ...]  # main packages; the binary takes the last path element

    @property
    def binaries(self) -> tuple[str, ...]:
        return tuple(p.rsplit("/", 1)[1] for p in self.packages)

    def ldflags(self) -> str:
        flags = ["-s", "-w"]
        if self.module == "kube":
            major, minor = self.version.lstrip("v").split(".")[:2]
            for pkg in VERSION_PACKAGES:
                flags += [f"-X {pkg}.{k}={v}" for k, v in (
                    ("gitVersion", self.version), ("gitMajor", major), ("gitMinor", minor),
                    ("gitCommit", KUBE_COMMIT), ("gitTreeState", "clean"), ("buildDate", KUBE_DATE))]
        return " ".join(flags)


TARGETS = (
    Target("kube", KUBE_VERSION, (
        "k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-scheduler", "k8s.io/kubernetes/cmd/kubectl",
        "kiln.dev/local/kube/cmd/etcd")),
    Target("kwok", KWOK_VERSION, ("sigs.k8s.io/kwok/cmd/kwok",)),
    Target("kube-score", KUBE_SCORE_VERSION, ("github.com/zegl/kube-score/cmd/kube-score",)),
    Target("helm", HELM_VERSION, ("helm.sh/helm/v3/cmd/helm",)),
)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln"


def bin_dir(target: Target) -> Path:
    return cache_root() / f"{target.module}-{target.version}" / "bin"


def inputs_digest(target: Target) -> str:
    """What the build reads beside the version: the module's go.mod, go.sum and sources, the flags."""
    digest = hashlib.sha256(f"{target.packages}\0{target.ldflags()}\0".encode())
    for path in sorted(p for p in (GOBUILD / target.module).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(GOBUILD)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def is_current(target: Target) -> bool:
    """Built, and from these inputs: a go.mod bump under the same version was never rebuilt. A
    build from before the digest was recorded is taken as current, and gets the record."""
    record = bin_dir(target).parent / "inputs.sha256"
    if not bin_dir(target).is_dir():
        return False
    if not record.exists():
        record.write_text(inputs_digest(target))
    return record.read_text() == inputs_digest(target)


def binary(name: str) -> Path:
    """Path of a built binary by name (kube-apiserver, etcd, kwok, ...)."""
    for target in TARGETS:
        if name in target.binaries:
            return bin_dir(target) / name
    raise KeyError(f"unknown binary {name!r}")


def find_go() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        raise RuntimeError("Go toolchain not found: put `go` (1.26+) on PATH or at /usr/local/go/bin/go")
    return go


def build_target(target: Target, jobs: int = 2, log: TextIO = sys.stderr) -> float:
    """Compile one module's binaries into the cache; returns the seconds it took."""
    final = bin_dir(target)
    tmp = final.with_name("bin.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
    cmd = [find_go(), "build", f"-p={jobs}", "-trimpath", f"-ldflags={target.ldflags()}",
           "-o", f"{tmp}/", *target.packages]
    print(f"building {target.module} {target.version}: {' '.join(target.binaries)}", file=log, flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=GOBUILD / target.module, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"go build failed in {GOBUILD / target.module}:\n{proc.stderr[-4000:]}")
    missing = [b for b in target.binaries if not (tmp / b).exists()]
    if missing:
        raise RuntimeError(f"go build produced no {missing} in {tmp}")
    shutil.rmtree(final, ignore_errors=True)  # a build from other inputs
    tmp.rename(final)
    (final.parent / "inputs.sha256").write_text(inputs_digest(target))
    seconds = time.monotonic() - start
    print(f"built {target.module} in {seconds:.0f}s -> {final}", file=log, flush=True)
    return seconds


def ensure_built(jobs: int = 2, log: TextIO = sys.stderr) -> dict[str, float]:
    """Build whatever is missing from the cache; returns build seconds per module built."""
    cache_root().mkdir(parents=True, exist_ok=True)
    # Two test sessions starting at once must not both write the same bin.tmp.
    with open(cache_root() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return {t.module: build_target(t, jobs, log) for t in TARGETS if not is_current(t)}
