"""The packaging split: `kiln[operator]` runs the operator and the router without torch.

The operator image installs only `.[operator]`; these tests run the operator's and the router's
entry points in a fresh interpreter where the engine's libraries cannot be imported (a
sys.meta_path finder refuses them), so any import chain that drags torch in fails here."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

from kiln.local.testing import eventually

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ONLY = ("torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "gguf", "jinja2",
               "llguidance")
# Prepended to each child's code: after it, `import torch` (or any ENGINE_ONLY) raises ImportError.
BLOCK = f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {ENGINE_ONLY!r}:
            raise ModuleNotFoundError(f"{{name}} is blocked: the operator image has no engine libraries", name=name)
sys.meta_path.insert(0, _Blocked())
"""


def run_blocked(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def requirement_names(reqs: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower() for r in reqs}


def test_the_blocker_blocks() -> None:
    done = run_blocked("import torch")
    assert done.returncode != 0 and "torch is blocked" in done.stderr


def test_extras_split_engine_from_operator() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base, engine, operator = (requirement_names(project["dependencies"]), requirement_names(extras["engine"]),
                              requirement_names(extras["operator"]))
    assert {"torch", "numpy", "safetensors", "tokenizers", "gguf", "jinja2"} <= engine
    assert {"kopf", "kubernetes", "pydantic", "aiohttp", "prometheus-client", "pyyaml"} <= base | operator
    assert not (base | operator) & set(ENGINE_ONLY)
    assert "kiln[engine,operator]" in extras["test"]


def test_every_file_the_engine_reads_beside_its_modules_is_packaged() -> None:
    """csrc/*.h were left out: a wheel's engine could not compile its C++ CPU ops (it fell back
    to the slower torch path, quietly). Every non-Python file of the packages must be package data."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, patterns in tool["package-data"].items():
        folder = ROOT / "engine" / Path(*package.split("."))
        files = [p for p in folder.glob("*/*") if p.is_file() and p.suffix not in (".py", ".pyc")
                 and p.parent.name != "__pycache__" and not (p.parent / "__init__.py").exists()]
        missing = [str(p.relative_to(folder)) for p in files if not any(p.relative_to(folder).match(pt)
                                                                        for pt in patterns)]
        assert files and not missing, (package, missing)


def test_operator_modules_and_cli_without_torch() -> None:
    code = """
import pkgutil, importlib, kiln.operator, kiln.router
for pkg in (kiln.operator, kiln.router):
    for mod in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(mod.name)
from kiln.operator import main
from kiln.operator.reconcile import Settings
registry = main.build_registry(None, Settings("engine:test", {}, 60.0, "http://prometheus"))
assert len(registry._watching.get_all_handlers()) == 1 + len(main.CHILDREN)
from kiln.cli import main as cli
for command in ("operator", "router", "crds"):
    try:
        cli([command, "--help"])
    except SystemExit as exit:
        assert exit.code == 0, (command, exit.code)
assert "torch" not in sys.modules
print("ok")
"""
    done = run_blocked(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("usage: kiln") == 3 and done.stdout.endswith("ok\n")


def test_an_engine_command_without_the_engine_extra_says_so() -> None:
    """The operator image (no torch): `kiln serve` was a traceback ending in "import torch"."""
    for argv in (["serve", "--model", "smollm2-135m"], ["generate", "--prompt", "hi"], ["eval", "--help"]):
        done = run_blocked(f"from kiln.cli import main; sys.exit(main({argv!r}))")
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert done.stderr.strip() == (f"kiln {argv[0]}: needs the engine extra (pip install 'kiln[engine]'): "
                                       f"no module named 'torch'")


def test_crds_generate_without_torch(tmp_path: Path) -> None:
    done = run_blocked(f"from kiln.cli import main; sys.exit(main(['crds', '--out-dir', {str(tmp_path)!r}]))")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "inferenceservices.kiln.dev.yaml").read_text() == \
        (ROOT / "crds" / "inferenceservices.kiln.dev.yaml").read_text()


def test_router_serves_without_torch() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"from kiln.cli import main; sys.exit(main(['router', '--host', '127.0.0.1', '--port', '{port}', " \
           f"'--endpoints', '127.0.0.1:9']))"
    proc = subprocess.Popen([sys.executable, "-c", BLOCK + code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        health = eventually(lambda: urllib.request.urlopen(f"{url}/health", timeout=5).status, "the router's /health",
                            timeout=60, ignore=(OSError,))
        assert health == 200
        document = json.load(urllib.request.urlopen(f"{url}/openapi.json", timeout=5))
        assert "/v1/chat/completions" in document["paths"]
        assert b"kiln_router" in urllib.request.urlopen(f"{url}/metrics", timeout=5).read()
        assert proc.poll() is None
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "blocked" not in out, out[-3000:]
