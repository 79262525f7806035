"""bench/cpu_common.write_result: a day's runs on one CPU kind keep a file each."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import cpu_common  # noqa: E402


def test_runs_of_a_day_keep_their_own_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_common, "RESULTS", tmp_path)
    monkeypatch.setattr(cpu_common, "_written", {})
    first = cpu_common.write_result("offline", {"run": 1, "partial": True})
    assert cpu_common.write_result("offline", {"run": 1}) == first  # a run's later write replaces its own
    monkeypatch.setattr(cpu_common, "_written", {})  # a second process, the same day
    second = cpu_common.write_result("offline", {"run": 2})
    assert second != first and second.name == first.name.replace(".json", "-2.json")
    assert json.loads(first.read_text()) == {"run": 1} and json.loads(second.read_text()) == {"run": 2}
    assert cpu_common.write_result("per-step", {}).name.startswith("per-step-")  # names apart


def test_machine_records_the_software(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CPU result's machine() has the versions (BENCHMARKS.md); torch's is None where torch
    cannot be imported (a venv with the operator extra only: the control-plane benchmarks)."""
    import platform
    import subprocess

    import torch

    m = cpu_common.machine()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cpu_common.REPO,
                          capture_output=True, text=True).stdout.strip()
    assert m["python"] == platform.python_version() and m["kiln_git"] == head and m["torch"] == torch.__version__
    assert {"cpu", "cores", "load_average", "cpu_flags"} <= set(m)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert cpu_common.versions()["torch"] is None


@pytest.mark.parametrize("script", ["autoscale", "canary_agreement", "cold_start", "prefix_routing",
                                    "tensor_parallel", "operator_handover", "images"])
def test_results_are_written_through_write_result(script: str) -> None:
    """A fixed <name>-<date>.json would replace the day's earlier run and lack the CPU kind."""
    source = (Path(cpu_common.__file__).parent / f"{script}.py").read_text()
    assert "write_result(" in source and "write_text(" not in source and "RESULTS" not in source
