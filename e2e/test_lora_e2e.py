"""LoRA adapters through the whole system: an InferenceService with `engine.adapters` becomes Ready,
its engine pod mounts the adapter and serves it under its name, and the router answers a request
naming the adapter with the in-process engine's greedy text for that adapter, lists it, and refuses
to load adapters into one replica. The adapter is a PEFT folder written here and served from a
hostpath:// source (the local test runtime runs pods as host processes)."""
from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import openai
import pytest

from e2e_support import PROMPT, REPO, Target, ready_with_its_engine_pod

sys.path.insert(0, str(REPO / "tests"))  # the adapter writer, shared with tests/
from lora_support import SMOLLM2, write_adapter  # noqa: E402

NAME = "smol-lora"

pytestmark = pytest.mark.timeout(1800)


def test_an_adapter_in_the_spec_is_served_under_its_name(target: Target, namespace: str, operator: None, base_url,
                                                         tmp_path_factory) -> None:
    if target.cluster is None:
        pytest.skip("the adapter is a hostpath:// folder written on this machine: the local cluster only")
    folder = tmp_path_factory.mktemp("lora") / "sql"
    write_adapter(folder, SMOLLM2, seed=21)
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
            "spec": {"model": {"name": "smol", "source": "builtin://smollm2-135m"}, "replicas": 1,
                     "engine": {"dtype": "float32", "maxModelLen": 256, "kvCache": {"memory": "64Mi"},
                                "adapters": [{"name": "sql", "source": f"hostpath://{folder}"}]},
                     "resources": {"cpu": "1", "memory": "2Gi"}}}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    try:
        pod = ready_with_its_engine_pod(target, namespace, NAME)
        command = pod["spec"]["containers"][0]["command"]
        assert command[command.index("--lora-modules") + 1:] == [f"sql={folder}"]

        from kiln.engine import LLM, SamplingParams
        llm = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=256, enable_lora=True,
                  lora_modules=(("sql", str(folder)),))
        params = SamplingParams(temperature=0.0, max_tokens=16)
        expected = {lora: llm.generate(PROMPT, params, lora=lora)[0].text for lora in (None, "sql")}
        assert expected[None] != expected["sql"]
        url = base_url(NAME)
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in api.models.list().data] == ["smol", "sql"]
        for model, lora in (("sql", "sql"), ("smol", None)):
            got = api.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
            assert got.model == model and got.choices[0].text == expected[lora]
        request = urllib.request.Request(url + "/v1/load_lora_adapter", data=b'{"lora_name": "x", "lora_path": "/x"}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403
    finally:
        target.kubectl("delete", "isvc", NAME, "-n", namespace, "--wait=false", check=False)
