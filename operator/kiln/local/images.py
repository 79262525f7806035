"""`kiln local images` (`make images`): build the engine and operator images with podman.

- Tools come from Debian's packages (podman, buildah, runc, debootstrap), installed when missing.
- podman runs with a containers.conf of Kiln's own (CONTAINERS_CONF, under the cache root):
  runc, since crun fails on cgroup v1 hybrid hosts, and `default_ulimits = []`, since a
  container may not raise limits above the host's own.
- No registry is reachable here, so the base image the Containerfiles name is made locally
  (`debootstrap --variant=minbase bookworm`, slimmed, imported under the standard name): the
  same Containerfiles build unchanged where a registry is reachable.
- The host's pip cache and CA bundle are mounted into the build (pip's cache and certificate).
- Cached by content: an image whose `dev.kiln.inputs` label is the digest of what it is built
  from is not rebuilt (a second run costs seconds). The torch layer depends on pyproject.toml
  only. The dependency stage is tagged, so pruning dangling layers (of failed or superseded
  builds) never drops it.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.local import build
from kiln.operator import images

REPO = Path(__file__).resolve().parents[3]
BASE = "docker.io/library/debian:bookworm-slim"
SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
PACKAGES = {"podman": "podman", "buildah": "buildah", "runc": "runc", "debootstrap": "debootstrap"}
INPUTS_LABEL = "dev.kiln.inputs"
BASE_LABEL, BASE_RECIPE = "dev.kiln.base", "2"  # bump when ensure_base() makes a different image
# What debian:*-slim configures (debuerreotype's --slimify): dpkg leaves docs, man pages and
# locales out of every later install, and apt deletes the .debs it downloaded.
SLIM_DPKG = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
"""
SLIM_APT = """\
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
"""
CONTAINERS_CONF = """\
# Written by kiln.local.images; podman reads it through CONTAINERS_CONF.
[containers]
# A container may not raise its limits above the host's: keep the host's.
default_ulimits = []
[engine]
# crun fails on cgroup v1 hybrid hosts.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


@dataclass(frozen=True)
class Built:
    component: str
    reference: str
    size: int  # bytes, as podman counts them (uncompressed layers)
    seconds: float
    cached: bool


def ensure_tools() -> None:
    """Install the Debian packages of the tools that are missing (as `make test` sets up the rest)."""
    missing = sorted({pkg for cmd, pkg in PACKAGES.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"missing {', '.join(missing)}; installing them needs root (apt-get)")
    print(f"installing {' '.join(missing)} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def podman_env() -> dict[str, str]:
    """The environment every podman call here runs with (Kiln's containers.conf)."""
    conf = build.cache_root() / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.parent.mkdir(parents=True, exist_ok=True)
        # Replaced whole, never rewritten in place: podman calls of other processes (pods,
        # builds, test sessions) read it meanwhile.
        with tempfile.NamedTemporaryFile("w", dir=conf.parent, prefix=".containers.conf.", delete=False) as tmp:
            tmp.write(CONTAINERS_CONF)
        os.chmod(tmp.name, 0o644)  # as write_text made it (the temp file is 0600)
        os.replace(tmp.name, conf)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], env=podman_env(), text=True,
                          capture_output=capture, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... (exit {done.returncode}): "
                           f"{(done.stderr or '').strip()[-2000:]}")
    return done


def exists(reference: str) -> bool:
    return podman("image", "exists", reference, check=False).returncode == 0


def inspect(reference: str, template: str) -> str:
    return podman("image", "inspect", "--format", template, reference).stdout.strip()


def ensure_base() -> bool:
    """Make BASE from Debian's archive unless local storage holds it (pulled from a registry: no
    label of ours; or made here by this recipe); True if made now."""
    if exists(BASE) and inspect(BASE, f'{{{{index .Labels "{BASE_LABEL}"}}}}') in ("<no value>", "", BASE_RECIPE):
        return False
    with tempfile.TemporaryDirectory(dir=build.cache_root()) as tmp:
        root = Path(tmp) / "rootfs"
        print(f"making {BASE} with debootstrap --variant=minbase {SUITE}", flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", SUITE, str(root), MIRROR], check=True,
                       stdout=subprocess.DEVNULL)
        # What debian:*-slim leaves out: package lists, downloaded .debs, docs, man pages, locales.
        for pattern in ("var/lib/apt/lists/*", "var/cache/apt/archives/*.deb", "usr/share/doc/*",
                        "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
            for path in root.glob(pattern):
                if path.name != "locale.alias" and path.name != "partial":
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        (root / "etc/dpkg/dpkg.cfg.d/docker").write_text(SLIM_DPKG)
        (root / "etc/apt/apt.conf.d/docker-clean").write_text(SLIM_APT)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "--change", 'CMD ["bash"]', "--change", f"LABEL {BASE_LABEL}={BASE_RECIPE}",
                        "-", BASE], stdin=tar.stdout,
                       env=podman_env(), check=True, stdout=subprocess.DEVNULL)
        tar.stdout.close()
        if tar.wait() != 0:
            # The import tagged what it got, labelled as this recipe's: the next run would take it for good.
            podman("rmi", "--force", BASE, check=False)
            raise RuntimeError("tar of the debootstrap root failed")
    return True


def containerfile(component: str) -> Path:
    return REPO / "images" / component / "Containerfile"


def context_files() -> list[Path]:
    """What the build context holds (see .containerignore): pyproject.toml and the sources."""
    files = [REPO / "pyproject.toml", REPO / ".containerignore", REPO / "images" / "requirements.py"]
    for top in ("engine", "operator"):
        files += [p for p in (REPO / top).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return sorted(files)


def inputs_digest(component: str, build_args: dict[str, str]) -> str:
    digest = hashlib.sha256(inspect(BASE, "{{.Id}}").encode())
    for path in [containerfile(component), *context_files()]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(repr(sorted(build_args.items())).encode())
    return digest.hexdigest()[:16]


def host_mounts() -> tuple[list[str], dict[str, str]]:
    """podman build options and build args that lend the build the host's pip cache and CA bundle."""
    cache = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
    cache.mkdir(parents=True, exist_ok=True)
    opts, args = ["--volume", f"{cache}:/host-pip-cache"], {"PIP_CACHE_DIR": "/host-pip-cache"}
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        opts += ["--volume", f"{bundle}:/host-ca.crt:ro"]
        args["PIP_CERT"] = "/host-ca.crt"
    return opts, args


def revision() -> str:
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:  # no git on this machine: the revision label is informational, not worth a failed build
        return "unknown"
    return done.stdout.strip() or "unknown"


def build_image(component: str, torch: str | None = None, force: bool = False) -> Built:
    """Build images.image(component) unless an image of the same inputs is there already."""
    reference = images.image(component)
    # Build args that change the image go into the digest; the mounts' paths do not.
    args = {"VERSION": images.version(), **({"TORCH": torch} if torch else {})}
    digest = inputs_digest(component, args)
    start = time.monotonic()
    if not force and exists(reference) and inspect(reference, f'{{{{index .Labels "{INPUTS_LABEL}"}}}}') == digest:
        return Built(component, reference, int(inspect(reference, "{{.Size}}")), time.monotonic() - start, True)
    opts, host_args = host_mounts()
    all_args = {**args, **host_args, "REVISION": revision()}
    common = ["build", "--network", "host", "--layers", "--force-rm", "-f", str(containerfile(component)),
              *opts, *(f"--build-arg={k}={v}" for k, v in all_args.items())]
    try:
        # The dependency stage under a name of its own: never dangling, so never pruned.
        podman(*common, "--target", "deps", "-t", f"localhost/kiln-build/{component}-deps:latest", str(REPO),
               capture=False)
        podman(*common, "--label", f"{INPUTS_LABEL}={digest}", "-t", reference, str(REPO), capture=False)
    finally:
        clean_up()
    return Built(component, reference, int(inspect(reference, "{{.Size}}")), time.monotonic() - start, False)


def clean_up() -> None:
    """What failed or superseded builds leave: a killed build's working containers (each holds its
    layer's files, GBs for torch) and dangling images. Tagged images and their layers stay."""
    listed = subprocess.run(["buildah", "containers", "--format", "{{.ContainerID}} {{.ContainerName}}"],
                            env=podman_env(), capture_output=True, text=True)
    stale = [line.split()[0] for line in listed.stdout.splitlines() if line.endswith("-working-container")
             or "-working-container-" in line]
    if stale:
        subprocess.run(["buildah", "rm", *stale], env=podman_env(), capture_output=True)
    podman("image", "prune", "--force", check=False)


def remove_containers(label: str) -> None:
    """Remove (killing) the containers carrying `label` (KEY=VALUE): what a killed runtime left."""
    if shutil.which("podman") is None:
        return
    ids = podman("ps", "--all", "--quiet", "--filter", f"label={label}", check=False).stdout.split()
    if ids:
        podman("rm", "--force", "--time", "0", *ids, check=False)


def build_all(components: tuple[str, ...] = images.COMPONENTS, torch: str | None = None,
              force: bool = False) -> list[Built]:
    lock = build.cache_root() / "images.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        # One build at a time: test sessions may ask at once. The tools' install is under the
        # lock too, or the second session's apt-get fails on the first one's dpkg lock.
        fcntl.flock(held, fcntl.LOCK_EX)
        ensure_tools()
        ensure_base()
        return [build_image(c, torch if c == "engine" else None, force) for c in components]


def run(components: tuple[str, ...], torch: str | None, force: bool) -> int:
    try:
        built = build_all(components, torch, force)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"kiln local images: {exc}", file=sys.stderr)
        return 1
    for b in built:
        how = "cached" if b.cached else f"built in {b.seconds:.0f}s"
        print(f"{b.reference:<36} {b.size / 1e6:8.0f} MB  {how}")
    return 0
