"""LoRA adapters in the engine (kiln.engine.lora) against a reference: HF transformers' SmolLM2 with the
adapter's update merged into its weights (W + alpha/r B A), and the engine's own outputs with the adapter
alone, in mixed batches, through the prefix cache and under the scheduler's max_loras."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engine.config import Config
from kiln.engine.lora import LoRAError, load_adapter
from kiln.engine.lora_cache import LoRACapacityError
from kiln.engine.llm import LLM
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.speculative import SpeculativeConfig

from lora_support import SMOLLM2, make_one_tensor_integer, merged_into, write_adapter
from test_model import forward_prefill, rel_err

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SCALES = {"sql": 16 / 8, "attn": 8 / 4 ** 0.5}  # the adapters' lora_alpha / r, and / sqrt(r) with rsLoRA


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_smollm2) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("loras")
    config = hf_smollm2[0].config
    return {"sql": (root / "sql", write_adapter(root / "sql", config, seed=1)),
            # attention only, rsLoRA scaling, another rank: each PEFT option the update reads
            "attn": (root / "attn", write_adapter(root / "attn", config, seed=2, rank=4, alpha=8,
                                                 targets=("q_proj", "v_proj"), use_rslora=True))}


@pytest.fixture(scope="module")
def merged(adapters, hf_smollm2) -> dict[str, torch.nn.Module]:
    """Per adapter, transformers' SmolLM2 with the update merged into its weights: what it means.
    Copies of the session's model (a load from the GGUF costs over twenty seconds)."""
    models = {}
    for name, (_, tensors) in adapters.items():
        models[name] = copy.deepcopy(hf_smollm2[0])
        merged_into(models[name], tensors, SCALES[name])
    return models


@pytest.fixture(scope="module")
def llm(adapters, smollm2_path) -> LLM:
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", enable_lora=True, max_loras=2,
              kv_cache_memory=64 << 20, max_model_len=256)
    for name, (path, _) in adapters.items():
        llm.add_lora(name, str(path))
    return llm


@pytest.mark.parametrize("name", SCALES)
def test_adapter_logits_match_transformers_with_the_update_merged(name, llm, merged, hf_smollm2) -> None:
    engine = llm.engine
    base, with_update = hf_smollm2[0], merged[name]
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    # the adapter on the middle prompt only: its rows, and no others, take the update
    logits = forward_prefill(engine.runner.model, prompts, [None, engine.loras.loaded[name], None])
    start = 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = (with_update if i == 1 else base)(torch.tensor([prompt])).logits[0]
            other = (base if i == 1 else with_update)(torch.tensor([prompt])).logits[0]
        got = logits[start:start + len(prompt)]
        assert rel_err(got, ref) < 1e-3
        assert rel_err(got, other) > 1e-2  # the update is large enough to tell apart
        start += len(prompt)


def alone(llm: LLM, prompt: str, lora: str | None) -> list[int]:
    return llm.generate(prompt, GREEDY, lora=lora)[0].token_ids


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llm) -> None:
    loras = [None, "sql", "attn"]
    expected = {(p, lora): alone(llm, p, lora) for p in PROMPTS for lora in loras}
    for p in PROMPTS:  # each adapter changes the text
        assert len({tuple(expected[p, lora]) for lora in loras}) == 3
    engine = llm.engine
    engine.block_manager.reset_prefix_cache()  # recomputed in one batch, not taken from the cache
    for i, (p, lora) in enumerate(expected):
        engine.add_request(f"mixed-{i}", p, GREEDY, lora)
    assert sorted({s.lora.name for s in engine.scheduler.waiting if s.lora}) == ["attn", "sql"]
    done = {}
    while engine.has_unfinished_requests():
        batch_loras = {s.lora.name if s.lora else None for s in engine.scheduler.running}
        assert len(batch_loras - {None}) <= 2
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [done[f"mixed-{i}"] for i in range(len(expected))] == list(expected.values())


def test_prefix_cache_is_never_shared_across_adapters(llm) -> None:
    engine = llm.engine
    prompt = ("In the spring of 1450, a goldsmith in Mainz began an experiment with movable metal type, oil-based "
              "ink and a wooden press adapted from those used for wine. His first project was")  # full blocks
    base = alone(llm, prompt, None)
    hits = engine.stats().prefix_cache_hits
    with_sql = alone(llm, prompt, "sql")
    assert engine.stats().prefix_cache_hits == hits  # the base model's blocks were not reused
    assert with_sql != base
    assert alone(llm, prompt, "sql") == with_sql
    assert engine.stats().prefix_cache_hits > hits  # but the adapter's own were


def test_max_loras_seats_adapters_and_base_requests_go_on(llm) -> None:
    engine = llm.engine
    engine.scheduler.max_loras = 1  # the fixture's is 2
    try:
        for i, lora in enumerate(["sql", "attn", None, "sql"]):
            engine.add_request(f"seat-{i}", PROMPTS[0], GREEDY, lora)
        engine.step()
        # attn waits for a seat; the sql request behind it waits too (no overtaking it), the base one runs
        assert sorted(engine.running_request_ids()) == ["seat-0", "seat-2"]
        finished = []
        while engine.has_unfinished_requests():
            finished += [o.request_id for o in engine.step() if o.finished]
        assert finished.index("seat-1") < finished.index("seat-3")
    finally:
        engine.scheduler.max_loras = engine.config.max_loras


def test_unload_and_reload_under_the_same_name(llm, adapters, tmp_path, hf_smollm2) -> None:
    engine = llm.engine
    before = alone(llm, PROMPTS[1], "attn")
    engine.add_request("busy", PROMPTS[1], GREEDY, "attn")
    engine.step()
    # Unloaded while a request runs with it: no new request may name it, the running one finishes
    # with it (its weights leave with that request), and nothing else waits for that.
    assert engine.remove_lora("attn") == 1 and len(engine.loras.retiring) == 1
    with pytest.raises(ValueError, match="no LoRA adapter named 'attn'"):
        llm.generate(PROMPTS[1], GREEDY, lora="attn")
    with pytest.raises(KeyError):
        engine.remove_lora("attn")
    finished = None
    while finished is None:
        finished = next((o for o in engine.step() if o.finished), None)
    assert finished.request_id == "busy" and finished.token_ids == before and engine.loras.retiring == []
    other = tmp_path / "other"
    write_adapter(other, hf_smollm2[0].config, seed=7, rank=4, alpha=8, targets=("q_proj", "v_proj"))
    llm.add_lora("attn", str(other))
    try:
        assert alone(llm, PROMPTS[1], "attn") != before  # the new weights, not the old cache
    finally:
        engine.remove_lora("attn")
        llm.add_lora("attn", str(adapters["attn"][0]))
    assert alone(llm, PROMPTS[1], "attn") == before


@pytest.fixture(scope="module")
def capped(adapters, smollm2_path) -> LLM:
    """An engine that keeps at most 2 adapters loaded, started with sql and attn."""
    return LLM(str(smollm2_path), dtype="float32", device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=2,
               kv_cache_memory=16 << 20, max_model_len=256,
               lora_modules=tuple((name, str(path)) for name, (path, _) in adapters.items()))


def test_past_max_cpu_loras_the_least_recently_used_adapter_is_unloaded_and_read_again(
        capped, llm, tmp_path, hf_smollm2, adapters) -> None:
    """vLLM's --max-cpu-loras: every adapter loaded stayed in memory. A third of two unloads the least
    recently used one; it is still served, and a request naming it reads it again from its folder."""
    engine = capped.engine
    assert list(engine.loras.loaded) == ["sql", "attn"]
    alone(capped, PROMPTS[0], "sql")  # now the most recently used
    write_adapter(tmp_path / "third", hf_smollm2[0].config, seed=5)
    capped.add_lora("third", str(tmp_path / "third"))
    assert list(engine.loras.loaded) == ["sql", "third"] and list(engine.loras.paths) == ["sql", "attn", "third"]
    assert alone(capped, PROMPTS[1], "attn") == alone(llm, PROMPTS[1], "attn")
    assert list(engine.loras.loaded) == ["third", "attn"]
    # Replacing an idle adapter (here by its own folder) takes its own room: the other one stays.
    engine.add_lora("attn", str(adapters["attn"][0]), replace=True)
    assert sorted(engine.loras.loaded) == ["attn", "third"]
    engine.remove_lora("third")


def test_an_adapter_a_request_holds_is_never_unloaded_for_room(capped, llm, adapters) -> None:
    """With every loaded adapter held by a running or waiting request, loading another (by the API, or
    for a request naming one unloaded for room) fails at once, the server's 429, and the requests
    finish with their own adapters' text; once they have, it loads."""
    engine = capped.engine
    sql_path = str(adapters["sql"][0])
    capped.add_lora("spare", sql_path)
    for lora in ("sql", "attn"):  # attn waits for sql's seat (max_loras 1), holding its adapter meanwhile
        engine.add_request(f"held-{lora}", PROMPTS[0], GREEDY, lora)
    engine.step()
    assert sorted(engine.loras.loaded) == ["attn", "sql"]  # spare was unloaded for them
    with pytest.raises(LoRACapacityError, match="all 2 loaded adapters"):
        capped.add_lora("fourth", sql_path)
    with pytest.raises(LoRACapacityError, match="'spare' cannot be loaded"):
        engine.add_request("refused", PROMPTS[0], GREEDY, "spare")
    assert "refused" not in engine.requests and "fourth" not in engine.loras.paths
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done == {f"held-{lora}": alone(llm, PROMPTS[0], lora) for lora in ("sql", "attn")}
    assert alone(capped, PROMPTS[0], "spare") == done["held-sql"]
    engine.remove_lora("spare")


@pytest.mark.parametrize("change, error", [
    (lambda d, c: (d / "adapter_config.json").unlink(), "must hold adapter_config.json"),
    (lambda d, c: (d / "adapter_config.json").write_text("{not json"), "is not JSON"),
    (lambda d, c: (d / "adapter_model.safetensors").write_bytes(b"\0" * 64), "cannot read"),
    (lambda d, c: write_adapter(d, c, 3, rank=32, alpha=32), "rank 32, more than --max-lora-rank 16"),
    (lambda d, c: write_adapter(d, c, 3, use_dora=True), "DoRA"),
    (lambda d, c: write_adapter(d, c, 3, bias="all"), "bias='all'"),
    (lambda d, c: write_adapter(d, c, 3, lora_bias=True), "LoRA biases"),
    (lambda d, c: write_adapter(d, c, 3, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda d, c: write_adapter(d, c, 3, layer_replication=[[0, 2], [1, 3]]), "layer_replication"),
    (lambda d, c: write_adapter(d, c, 3, r=0), "positive integer r"),
    (lambda d, c: write_adapter(d, c, 3, r=4), "has rank 8, adapter_config.json says r=4"),
    (lambda d, c: write_adapter(d, c, 3, layers=range(40, 41)), "layer 40; the model has 30"),
    (lambda d, c: (d / "adapter_config.json").write_text("[]"), "is not a JSON object"),
    (lambda d, c: (d / "adapter_config.json").write_bytes(b'{"r": 8, "lora_alpha": "\xff"}'), "is not JSON"),
    (lambda d, c: write_adapter(d, c, 3, alpha=float("nan")), "finite lora_alpha"),  # json writes NaN
    (lambda d, c: write_adapter(d, c, 3, alpha=10 ** 400), "finite lora_alpha"),  # an int past float's range
    (lambda d, c: (d / "adapter_config.json").write_text('{"r": 8, "x": ' + "[" * 10 ** 5 + "]" * 10 ** 5 + "}"),
     "is not JSON"),  # nested past Python's recursion limit
    (lambda d, c: _rename(d, "self_attn.q_proj", "mlp.q_proj"), "only those take adapters"),
    (lambda d, c: _rename(d, "base_model.model.model.layers.2.", "model.layers.2.", keep=True),
     r"layer 2's \w+\.\w+ lora_[AB] is in \S+ twice"),  # PEFT's prefix and the bare one
    (lambda d, c: _poison(d / "adapter_model.safetensors"), "layer 2 o_proj has weights that are not finite"),
    (lambda d, c: make_one_tensor_integer(d), r"tensor 'base_model\.model\.model\.layers\.2\.self_attn\.o_proj\.lora_B"
     r"\.weight' in \S+/bad/adapter_model\.safetensors is torch\.int8, not a floating-point type"),
])
def test_an_adapter_that_cannot_be_served_is_refused_by_name(change, error, tmp_path, hf_smollm2, llm) -> None:
    folder = tmp_path / "bad"
    write_adapter(folder, hf_smollm2[0].config, seed=3)
    change(folder, hf_smollm2[0].config)
    with pytest.raises(LoRAError, match=error):
        load_adapter("bad", str(folder), llm.engine.runner.model, 16)
    assert "bad" not in llm.engine.loras.paths


def _rename(folder: Path, old: str, new: str, keep: bool = False) -> None:
    """Tensors renamed (or, with keep, copied under the new name) in an adapter's file."""
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    renamed = {key.replace(old, new): tensor.clone() for key, tensor in tensors.items() if old in key}
    save_file({**{k: t for k, t in tensors.items() if keep or old not in k}, **renamed},
              str(folder / "adapter_model.safetensors"))


def _poison(tensors_file: Path) -> None:
    """One inf in an adapter's weights: served, its requests would sample from clamped garbage."""
    tensors = load_file(str(tensors_file))
    tensors["base_model.model.model.layers.2.self_attn.o_proj.lora_B.weight"][0, 0] = float("inf")
    save_file(tensors, str(tensors_file))


def test_an_adapter_of_another_model_or_module_is_refused(tmp_path, hf_smollm2, llm) -> None:
    config = hf_smollm2[0].config
    tensors = write_adapter(tmp_path, config, seed=4, layers=range(1))
    key = next(iter(tensors))
    b_key = key.replace("lora_A", "lora_B")
    save_file({key: tensors[key][:, :100].contiguous(), b_key: tensors[b_key]},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="an adapter of another base model"):
        load_adapter("wrong", str(tmp_path), llm.engine.runner.model, 16)
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 49152)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="only those take adapters"):
        load_adapter("embed", str(tmp_path), llm.engine.runner.model, 16)
    save_file({key: tensors[key]}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="without its other half"):
        load_adapter("half", str(tmp_path), llm.engine.runner.model, 16)


def test_a_file_holding_other_tensors_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch) -> None:
    """A path to a whole model's checkpoint is refused from the file's header: every tensor was read
    into host memory first (enough to OOM-kill the pod for a large model)."""
    write_adapter(tmp_path, SMOLLM2, seed=5, layers=range(1))
    tensors_file = tmp_path / "adapter_model.safetensors"
    save_file({**load_file(str(tensors_file)), "model.embed_tokens.weight": torch.zeros(8, 576)}, str(tensors_file))
    reads: list[str] = []

    def spy(path: str, *args, **kwargs) -> dict[str, torch.Tensor]:
        reads.append(path)
        return load_file(path, *args, **kwargs)
    monkeypatch.setattr("kiln.engine.lora.load_file", spy)
    with pytest.raises(LoRAError, match=r"LoRA adapter 'checkpoint': tensor 'model\.embed_tokens\.weight' is not a "
                                        r"LoRA weight of an attention or MLP projection .*only those take adapters"):
        load_adapter("checkpoint", str(tmp_path), torch.nn.Module(), 16)  # refused before the model is looked at
    assert reads == []


def test_lora_settings_are_checked(llm, adapters) -> None:
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora("sql", str(adapters["sql"][0]))
    for field in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
            Config(**{field: 0})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be at least max_loras \(3\)"):
        Config(max_loras=3, max_cpu_loras=2)
    assert Config().lora_capacity == 8 and Config(max_loras=12).lora_capacity == 12
    with pytest.raises(ValueError, match="enable_lora must be true or false"):
        Config(enable_lora="yes")


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int4")])
def test_adapters_apply_on_bf16_and_quantized_projections(dtype, quantization, adapters, merged, smollm2_path,
                                                           variant_cache) -> None:
    """The hooks sit on whatever module a projection is (quantized variants swap them): the adapter moves
    the logits toward transformers' merged model, from where the base variant's are."""
    path, _ = adapters["sql"]
    engine = LLMEngine(Config(model=str(smollm2_path), dtype=dtype, device="cpu", enable_lora=True,
                              quantization=quantization, quantization_cache=str(variant_cache),
                              kv_cache_memory=16 << 20, max_model_len=256))
    adapter = engine.add_lora("sql", str(path))
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    with_adapter = forward_prefill(engine.runner.model, prompts, [adapter] * len(prompts)).float()
    without = forward_prefill(engine.runner.model, prompts, [None] * len(prompts)).float()
    with torch.no_grad():
        ref = torch.cat([merged["sql"](torch.tensor([p])).logits[0] for p in prompts])
    # int4's own rounding (0.25 from the merged model's logits on SmolLM2 in bf16) is most of the
    # error there: the adapter must not add to it. int8's is small enough to halve the error.
    assert rel_err(with_adapter, ref) < rel_err(without, ref) * (1.0 if quantization == "int4" else 0.5)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_an_adapter_on_an_awq_variant_moves_the_logits_as_on_the_float_model(quantization, adapters, merged,
                                                                             hf_smollm2, smollm2_path,
                                                                             variant_cache) -> None:
    """AWQ divides the norms before qkv and gate_up by s, so those projections see x / s: the adapter's
    A is scaled by s to give its update on x. Unscaled, the update was off by 1/s per channel, and the
    adapter's effect (logits with it minus without) was about as far from the merged model's as the
    effect itself; now it is off by the variant's rounding only."""
    path, _ = adapters["sql"]
    engine = LLMEngine(Config(model=str(smollm2_path), dtype="float32", device="cpu", enable_lora=True,
                              quantization=quantization, quantization_cache=str(variant_cache),
                              kv_cache_memory=16 << 20, max_model_len=256))
    adapter = engine.add_lora("sql", str(path))
    prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
    effect = (forward_prefill(engine.runner.model, prompts, [adapter] * len(prompts)).float()
              - forward_prefill(engine.runner.model, prompts, [None] * len(prompts)).float())
    with torch.no_grad():
        meant = torch.cat([merged["sql"](torch.tensor([p])).logits[0] - hf_smollm2[0](torch.tensor([p])).logits[0]
                           for p in prompts])
    # Measured on SmolLM2: int8 0.09 (0.24 unscaled), fp8 0.34 (0.74 unscaled: e4m3 rounds coarsely).
    assert rel_err(effect, meant) < {"int8": 0.15, "fp8": 0.5}[quantization]


def test_speculative_decoding_checks_drafts_with_the_adapter(llm, adapters, smollm2_path) -> None:
    """N-gram drafts are checked in a step whose rows carry the adapter: greedy text is the same."""
    speculating = LLM(str(smollm2_path), dtype="float32", device="cpu", enable_lora=True, max_model_len=256,
                      kv_cache_memory=64 << 20, lora_modules=(("sql", str(adapters["sql"][0])),),
                      speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1))
    prompt = "List: red, green, blue, red, green, blue, red, green,"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = speculating.generate(prompt, params, lora="sql")[0].token_ids
    assert got == llm.generate(prompt, params, lora="sql")[0].token_ids
    assert speculating.engine.num_accepted_tokens > 0  # drafts were checked, and some kept


def test_a_draft_model_guesses_for_adapter_requests_and_the_adapter_checks(llm, adapters, smollm2_path) -> None:
    """A draft model beside adapters loaded at start (it once refused them: the draft's copy of the config
    kept lora_modules without enable_lora): the draft guesses with its own weights, the target checks with
    each request's adapter, so greedy text is what the adapter gives alone."""
    drafted = LLM(str(smollm2_path), dtype="float32", device="cpu", enable_lora=True, max_model_len=256,
                  kv_cache_memory=64 << 20, lora_modules=(("sql", str(adapters["sql"][0])),),
                  speculative=SpeculativeConfig(method="draft_model", model=str(smollm2_path),
                                                num_speculative_tokens=3))
    prompt = "List: red, green, blue, red, green, blue, red, green,"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = drafted.engine
    for lora in ("sql", None):
        engine.add_request(f"drafted-{lora}", prompt, params, lora)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for lora in ("sql", None):
        assert done[f"drafted-{lora}"] == llm.generate(prompt, params, lora=lora)[0].token_ids, lora
    assert engine.num_draft_tokens > 0 and engine.num_accepted_tokens > 0
