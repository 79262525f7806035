"""Cluster-wide placement defaults for engine pods (kiln operator --gpu-node-selector, ...):
parsed from the operator's flags, merged under an InferenceService's own choices, rendered
into the engine Deployment's pod spec."""
from __future__ import annotations

import argparse

import pytest

from kiln.operator import main
from kiln.operator.models import InferenceServiceSpec
from kiln.operator.placement import Placement, Placements, parse_label, parse_toleration, placed
from kiln.operator.render import Owner, render_deployment

GPU_FLAGS = ["--gpu-node-selector=nvidia.com/gpu.present=true", "--gpu-toleration=nvidia.com/gpu:NoSchedule",
             "--cpu-node-selector=kubernetes.io/arch=amd64"]


def spec(gpus: int, **resources: object) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"source": "builtin://smollm2-135m"},
                                                "resources": {"gpus": gpus, **resources}})


def from_flags(flags: list[str]) -> Placements:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return main.placements(parser.parse_args(flags))


def pod_spec(s: InferenceServiceSpec) -> dict:
    return render_deployment(Owner("chat", "ml", "uid-1"), s, "engine:test")["spec"]["template"]["spec"]


def test_gpu_engines_get_the_gpu_defaults_and_cpu_engines_the_cpu_ones() -> None:
    where = from_flags(GPU_FLAGS)
    gpu = pod_spec(placed(spec(1), where))
    assert gpu["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    cpu = pod_spec(placed(spec(0), where))
    assert cpu["nodeSelector"] == {"kubernetes.io/arch": "amd64"} and "tolerations" not in cpu


def test_the_services_own_choices_win_and_are_kept() -> None:
    own = spec(2, nodeSelector={"nvidia.com/gpu.present": "false", "pool": "a100"},
               tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"},
                            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    got = pod_spec(placed(own, from_flags(GPU_FLAGS)))
    assert got["nodeSelector"] == {"nvidia.com/gpu.present": "false", "pool": "a100"}
    assert [t["key"] for t in got["tolerations"]] == ["dedicated", "nvidia.com/gpu"]  # no duplicate


def test_an_empty_toleration_key_or_value_is_left_out_as_the_api_server_stores_it() -> None:
    from kiln.operator.plan import contains
    own = spec(1, tolerations=[{"key": "", "operator": "Exists"}, {"key": "pool", "value": "", "effect": "NoSchedule"}])
    for s in (own, placed(spec(1), from_flags(["--gpu-toleration=nvidia.com/gpu=:NoSchedule"]))):
        wanted = pod_spec(s)["tolerations"]
        stored = [{k: v for k, v in t.items() if v != ""} for t in wanted]  # omitempty, as the API server keeps it
        assert contains(stored, wanted) and all("" not in t.values() for t in wanted), wanted
    assert pod_spec(own)["tolerations"] == [{"operator": "Exists"}, {"key": "pool", "operator": "Equal",
                                                                     "effect": "NoSchedule"}]


def test_no_defaults_leave_the_spec_alone() -> None:
    s = spec(1)
    assert placed(s, Placements()) is s
    assert placed(s, Placements(cpu=Placement({"a": "b"}))) is s


@pytest.mark.parametrize("text, want", [
    ("nvidia.com/gpu", {"key": "nvidia.com/gpu", "operator": "Exists"}),
    ("dedicated=ml:NoExecute", {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"}),
])
def test_toleration_syntax(text: str, want: dict) -> None:
    assert parse_toleration(text, "--gpu-toleration").model_dump(exclude_none=True) == want


@pytest.mark.parametrize("flag", ["--gpu-toleration=:NoSchedule", "--gpu-toleration=a:Sometimes",
                                  "--cpu-node-selector=novalue", "--gpu-node-selector==x"])
def test_bad_flags_are_refused_naming_the_flag(flag: str) -> None:
    with pytest.raises(ValueError, match=flag.split("=")[0]):
        from_flags([flag])


def test_bad_flags_exit_2_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli import main as cli
    assert cli(["operator", "--gpu-toleration=nvidia.com/gpu:Always"]) == 2
    assert "--gpu-toleration takes KEY[=VALUE][:EFFECT]" in capsys.readouterr().err
    assert parse_label("nvidia.com/gpu.present=true", "--x") == ("nvidia.com/gpu.present", "true")
    assert parse_label("a=", "--x") == ("a", "")  # an empty label value is one
    with pytest.raises(ValueError, match="'b=c' is not a label value"):
        parse_label("a=b=c", "--x")


@pytest.mark.parametrize("key", ["bad key!", "", "a/" + "n" * 64, "-lead"])
def test_a_node_selector_key_kubernetes_refuses_is_refused_with_the_spec(key: str) -> None:
    # Else accepted, and every engine Deployment applied from it answered 422: no revision, ever.
    with pytest.raises(ValueError, match=f"resources.nodeSelector: {key!r} is not a label key"):
        spec(1, nodeSelector={"pool": "a", key: "v"})
    assert spec(1, nodeSelector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}).resources.nodeSelector
