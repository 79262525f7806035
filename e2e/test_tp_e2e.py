"""Tensor parallelism through the whole system (issue 19): an InferenceService with `gpus: 2` and
`engine.tensorParallelSize: 2` becomes Ready on a kwok GPU node, its pod asks for 2 GPUs and runs
`kiln serve --tensor-parallel-size 2`, and it answers with the TP=1 greedy text. The model is the
tests' tiny random Llama (4 query / 2 KV heads: SmolLM2's 9 query heads do not split in 2),
written here and served from a hostpath:// source. The local test runtime runs the pod as a host
process without GPUs, so the two ranks run on the CPU over gloo: the same engine code as NCCL
on GPUs, the process group's backend aside."""
from __future__ import annotations

import json
import sys

import openai
import pytest

from e2e_support import REPO, Target, ready_with_its_engine_pod

sys.path.insert(0, str(REPO / "tests"))  # the tiny model's writer, shared with tests/
from tiny_models import write_tiny_model  # noqa: E402

NAME = "tiny-tp2"
PROMPT = "w5 w17 w3 w42 w8"

pytestmark = pytest.mark.timeout(1800)


def test_tp2_service_on_a_gpu_node_asks_two_gpus_and_answers_like_tp1(target: Target, namespace: str,
                                                                      operator: None, base_url,
                                                                      tmp_path_factory) -> None:
    if target.cluster is None:
        pytest.skip("the model is a hostpath:// folder written on this machine: the local cluster only")
    folder = write_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))
    body = {"apiVersion": "kiln.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
            "spec": {"model": {"name": "tiny", "source": f"hostpath://{folder}"}, "replicas": 1,
                     "engine": {"dtype": "float32", "maxModelLen": 256, "tensorParallelSize": 2,
                                "kvCache": {"memory": "16Mi"}},
                     "resources": {"gpus": 2, "cpu": "1", "memory": "2Gi"}}}
    target.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    try:
        pod = ready_with_its_engine_pod(target, namespace, NAME)
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert c["command"][-2:] == ["--tensor-parallel-size", "2"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        node = json.loads(target.kubectl("get", "node", pod["spec"]["nodeName"], "-o", "json"))
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"

        from kiln.engine import LLM, SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=16)
        expected = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256).generate(PROMPT, params)[0]
        api = openai.OpenAI(base_url=base_url(NAME) + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == expected.text and got.usage.completion_tokens == len(expected.token_ids)
    finally:
        target.kubectl("delete", "isvc", NAME, "-n", namespace, "--wait=false", check=False)
