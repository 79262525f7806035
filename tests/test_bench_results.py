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
