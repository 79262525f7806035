"""Images: sizes, build time (cold and warm), and the engine's start time (process start -> /ready)
from the engine image (podman + runc) beside the same engine as a process of the venv.

    .venv/bin/python bench/images.py [--cold] [--runs 3]   # writes bench/results/images-<date>-<cpu kind>.json

--cold first removes Kiln's images and build cache (the base image and the host's pip cache stay:
the downloads are not what is measured), then builds both; without it the build is what
`make images` costs now. "warm" is a second `make images` (nothing changed: the inputs digest
matches; rebuilds forced by sources edited meanwhile are listed beside it); "forced, layers
cached" runs podman's build with its layer cache, the floor of what a code change costs (a real
change re-runs the wheel stage and the final install on top of that).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_common import machine, write_result  # noqa: E402

from kiln.local import images  # noqa: E402
from kiln.operator import images as names  # noqa: E402

SERVE = ["serve", "--model", "smollm2-135m", "--dtype", "float32", "--max-model-len", "2048",
         "--kv-cache-memory", str(256 << 20), "--host", "127.0.0.1"]


def forget_images() -> None:
    for component in names.COMPONENTS:
        images.podman("rmi", "--force", names.image(component), f"localhost/kiln-build/{component}-deps:latest",
                      check=False)
    images.podman("image", "prune", "--force", check=False)


def build(force: bool = False) -> dict:
    start = time.monotonic()
    built = images.build_all(force=force)
    return {"seconds": round(time.monotonic() - start, 1),
            **{b.component: {"seconds": round(b.seconds, 1), "cached": b.cached} for b in built}}


def warm() -> dict:
    """`make images` with nothing changed. In a working tree others edit, a source may change
    between two builds: that build is a real (layer-cached) rebuild, recorded, and it tries again."""
    rebuilds = []
    for _ in range(4):
        result = build()
        if all(result[c]["cached"] for c in names.COMPONENTS):
            return {**result, "rebuilds_first": rebuilds}
        rebuilds.append(result)
    raise RuntimeError(f"sources kept changing: {rebuilds}")


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the engine was not ready in time")


def start_once(mode: str, port: int, log: Path) -> float:
    if mode == "process":
        argv, env = [sys.executable, "-m", "kiln.cli", *SERVE, "--port", str(port)], None
    else:  # as the runtime's container mode runs it: non-root, read-only root, /tmp an empty volume
        argv = ["podman", "--runtime", "runc", "run", "--rm", "--network", "host", "--read-only",
                "--read-only-tmpfs=false", "--mount", "type=tmpfs,destination=/tmp", "--user", "10001:10001",
                "--name", f"kiln-bench-{port}", names.image("engine"), *SERVE, "--port", str(port)]
        env = images.podman_env()
    start = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(port, proc)
        return time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="remove Kiln's images and build cache first")
    parser.add_argument("--runs", type=int, default=3, help="engine starts per mode (default 3)")
    args = parser.parse_args()
    record: dict = {"machine": machine(), "images": {}, "build": {}, "engine_start_s": {}}
    if args.cold:
        forget_images()
        record["build"]["cold"] = build()
    record["build"]["warm"] = warm()
    record["build"]["forced_layers_cached"] = build(force=True)
    for component in names.COMPONENTS:
        ref = names.image(component)
        record["images"][component] = {"reference": ref, "bytes": int(images.inspect(ref, "{{.Size}}"))}
    log = Path("/tmp/kiln-bench-images.log")
    runs: dict[str, list[float]] = {"process": [], "container": []}
    for i in range(args.runs):  # alternated, so a load change hits both
        for mode in runs:
            runs[mode].append(round(start_once(mode, 18600 + i, log), 2))
    record["engine_start_s"] = {mode: {"runs": r, "median": statistics.median(r)} for mode, r in runs.items()}
    for component, info in record["images"].items():
        print(f"{info['reference']:<36} {info['bytes'] / 1e6:8.0f} MB")
    print("build:", record["build"])
    print("engine start (process start -> /ready):",
          {m: v["median"] for m, v in record["engine_start_s"].items()})
    print(write_result("images", record))


if __name__ == "__main__":
    main()
