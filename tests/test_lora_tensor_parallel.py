"""LoRA adapters on a tensor-parallel engine (gloo on the CPU): every rank applies its cut of each
adapter, so the logits and greedy tokens are those of the TP=1 engine with the same adapters, for
adapters given at start and loaded or unloaded while the engine runs, in batches that mix them with
base-model requests. TP=4 replicates the tiny model's 2 KV heads (each rank's k/v rows of B come
from the shared head); int8 projections take adapters on every rank too. `kiln serve` with TP=2 serves
adapters given by --lora-modules and loaded or unloaded over HTTP, with the TP=1 text."""
from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.engine import tp_ranks
from kiln.engine.context import prefill_context, reset_context, set_context
from kiln.engine.llm import LLM
from kiln.engine.lora import LoRAAdapter, LoRANotLoadedError, lora_mapping
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.speculative import SpeculativeConfig
from kiln.engine.tensor_parallel import Shard

from lora_support import write_adapter
from test_lora_server import adapter_call
from test_server import MODEL, ServerProcess, post
from test_tensor_parallel import GREEDY_64, TINY, TINY_PROMPTS, assert_no_ranks_left
from tiny_models import TINY_HF_CONFIGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# One adapter name (or None: the base model) per prompt of TINY_PROMPTS.
NAMES = [None, "all", "attn", "mlp", "all"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    config = SimpleNamespace(**TINY_HF_CONFIGS["llama"][1])
    root = tmp_path_factory.mktemp("tp-loras")
    # every projection; attention only with rsLoRA and another rank (o_proj: row-parallel); MLP only
    write_adapter(root / "all", config, seed=1, alpha=64)
    write_adapter(root / "attn", config, seed=2, rank=4, alpha=32, targets=("q_proj", "v_proj", "o_proj"),
                  use_rslora=True)
    write_adapter(root / "mlp", config, seed=3, rank=2, alpha=32, targets=("gate_proj", "down_proj"))
    return {name: root / name for name in ("all", "attn", "mlp")}


def start(model_dir: Path, adapter_dirs: dict[str, Path], tp: int, quantization: str = "none",
          cache: Path | None = None, **settings: object) -> LLM:
    """An engine with "all" given at start and the other two loaded while it runs."""
    llm = LLM(str(model_dir), tensor_parallel_size=tp, enable_lora=True, max_loras=3,
              lora_modules=(("all", str(adapter_dirs["all"])),), quantization=quantization,
              quantization_cache=str(cache) if cache else "off", **TINY, **settings)
    try:
        for name in ("attn", "mlp"):
            llm.add_lora(name, str(adapter_dirs[name]))
    except BaseException:  # not returned, so no test closes it: open, it refuses every later TP engine
        llm.close()
        raise
    return llm


def logits(llm: LLM) -> torch.Tensor:
    """One prefill of TINY_PROMPTS, each with its adapter of NAMES, through rank 0's model."""
    engine = llm.engine
    context = prefill_context([len(p) for p in TINY_PROMPTS])
    context.lora = lora_mapping([(engine.loras.loaded[n] if n else None, len(p))
                                 for n, p in zip(NAMES, TINY_PROMPTS)], torch.device("cpu"))
    set_context(context)
    try:
        with torch.inference_mode():
            ids = torch.tensor([t for p in TINY_PROMPTS for t in p])
            positions = torch.tensor([i for p in TINY_PROMPTS for i in range(len(p))])
            return engine.runner.model.compute_logits(engine.runner.model(ids, positions))
    finally:
        reset_context()


def mixed(llm: LLM, names: list[str | None]) -> list[list[int]]:
    """Greedy tokens of TINY_PROMPTS, prompt i with adapter names[i], all in one engine's batches."""
    engine, run = llm.engine, next(_ids)
    for i, (prompt, name) in enumerate(zip(TINY_PROMPTS, names)):
        engine.add_request(f"mixed-{run}-{i}", prompt, GREEDY_64, name)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[f"mixed-{run}-{i}"] for i in range(len(names))]


@pytest.mark.parametrize("tp, quantization", [(2, "none"), (4, "none"), (2, "int8")])
def test_adapters_on_a_tensor_parallel_engine_give_tp1s_logits_and_tokens(tp, quantization, tiny_llama_dir,
                                                                           adapter_dirs, tmp_path):
    reference = start(tiny_llama_dir, adapter_dirs, 1, quantization, tmp_path)
    want = mixed(reference, NAMES)
    base = mixed(reference, [None] * len(NAMES))
    assert all(w != b for w, b, name in zip(want, base, NAMES) if name)  # each adapter changes the text
    llm = start(tiny_llama_dir, adapter_dirs, tp, quantization, tmp_path)
    try:
        assert llm.engine.runner.model.shard.size == tp
        torch.testing.assert_close(logits(llm), logits(reference), rtol=1e-5, atol=1e-4)
        assert mixed(llm, NAMES) == want
        # Unloaded from every rank, then refused; loaded again under the name (a new id on the workers,
        # whose forward would fail on an id they do not hold).
        llm.engine.remove_lora("attn")
        with pytest.raises(LoRANotLoadedError):
            llm.engine.add_request("gone", TINY_PROMPTS[2], GREEDY_64, "attn")
        assert mixed(llm, [n if n != "attn" else None for n in NAMES])[2] == base[2]
        llm.add_lora("attn", str(adapter_dirs["attn"]))
        assert mixed(llm, NAMES) == want
    finally:
        assert_no_ranks_left(llm)


def test_a_draft_model_guesses_for_a_tensor_parallel_target_with_adapters(tiny_llama_dir, adapter_dirs):
    """The draft (whole, on rank 0, no adapter) guesses; every rank checks with each row's adapter."""
    want = mixed(start(tiny_llama_dir, adapter_dirs, 1), NAMES)
    llm = start(tiny_llama_dir, adapter_dirs, 2, speculative=SpeculativeConfig(
        method="draft_model", model=str(tiny_llama_dir), num_speculative_tokens=3))
    try:
        assert mixed(llm, NAMES) == want
        assert llm.engine.num_accepted_tokens > 0
    finally:
        assert_no_ranks_left(llm)


def test_a_tensor_parallel_server_serves_adapters_from_its_flags_and_over_http(tiny_llama_dir, adapter_dirs):
    prompt, params = " ".join(f"w{i % 90}" for i in range(12)), SamplingParams(temperature=0, max_tokens=16)
    reference = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, **TINY,
                    lora_modules=tuple((name, str(adapter_dirs[name])) for name in ("all", "mlp")))
    want = {name: reference.generate(prompt, params, lora=name)[0].text for name in (None, "all", "mlp")}
    assert len(set(want.values())) == 3
    server = ServerProcess("--model", str(tiny_llama_dir), "--tensor-parallel-size", "2", "--max-model-len", "256",
                           "--kv-cache-memory", "4Mi", "--enable-lora", "--max-loras", "2",
                           "--lora-modules", f"all={adapter_dirs['all']}")

    def completion(model: str) -> tuple[int, dict]:
        return post(server.url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0})
    try:
        assert adapter_call(f"{server.url}/v1/load_lora_adapter", {"lora_name": "mlp",
                                                                   "lora_path": str(adapter_dirs["mlp"])})[0] == 200
        for model, name in ((MODEL, None), ("all", "all"), ("mlp", "mlp")):
            code, reply = completion(model)
            assert code == 200 and reply["choices"][0]["text"] == want[name], reply
        assert adapter_call(f"{server.url}/v1/unload_lora_adapter", {"lora_name": "mlp"})[0] == 200
        assert completion("mlp")[0] == 404
        code, reply = completion("all")  # the other adapter still runs on both ranks
        assert code == 200 and reply["choices"][0]["text"] == want["all"], reply
    finally:
        server.stop()


def test_rank_0_cuts_an_adapter_before_the_workers_are_sent_it(monkeypatch):
    """A cut that fails on rank 0 (shapes, out of memory) sends the workers nothing: sent first, each
    worker kept its copy for good (the adapter cache, never holding the adapter, never removes it).
    No ranks spawned: a runner with a stand-in group records what would be sent."""
    sent: list[str] = []
    runner = tp_ranks.LeaderRunner.__new__(tp_ranks.LeaderRunner)
    runner.group = SimpleNamespace(send=lambda kind, *_: sent.append(kind))
    runner.model = SimpleNamespace(inner=SimpleNamespace(config=None), shard=Shard(0, 2))
    adapter = LoRAAdapter("a", "/adapters/a", 8, next(_ids), {})

    def cut_fails(*_: object) -> LoRAAdapter:
        raise torch.OutOfMemoryError("no room for rank 0's cut")
    with monkeypatch.context() as patch:
        patch.setattr(tp_ranks, "shard_adapter", cut_fails)
        with pytest.raises(torch.OutOfMemoryError):
            runner.add_lora(adapter)
    assert sent == []
    assert runner.add_lora(adapter).name == "a" and sent == ["add_lora"]  # the cut done, then sent
