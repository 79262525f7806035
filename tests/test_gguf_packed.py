"""GGUF Q8_0 / Q4_0 / Q4_1 served packed (kiln.engine.gguf_quant): the Kiln forms dequantize to
gguf's own float32 values bit for bit, the CPU matmuls and the Triton kernels (interpreted, as in
test_kernels.py) agree with dequantize-then-matmul, and the SmolLM2 GGUF (Q4_1) served packed gives
the dequantized model's greedy tokens at about 5 bits per decoder weight."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined

from pathlib import Path  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from test_loader import Q, write_gguf, write_gguf_like_llama_cpp  # noqa: E402

from kiln.engine.config import Config, ModelLoadError  # noqa: E402
from kiln.engine.context import prefill_context, reset_context, set_context  # noqa: E402
from kiln.engine.gguf_loader import dequantize, open_gguf, unpermute_qk  # noqa: E402
from kiln.engine.gguf_quant import PackedWeight, read_packed  # noqa: E402
from kiln.engine.kernels import quant_gemm  # noqa: E402
from kiln.engine.loader import load_model  # noqa: E402
from kiln.engine.quantization import Int4Linear, Int8Linear, QuantLinear, resident_weight_bytes  # noqa: E402

KINDS = ["Q8_0", "Q4_0", "Q4_1"]


def synthetic(tmp_path: Path, kind: str, rows: int = 48, cols: int = 96) -> gguf.ReaderTensor:
    """A GGUF tensor quantized by gguf itself, from rows of very different magnitudes and signs."""
    rng = np.random.default_rng(KINDS.index(kind))
    w = rng.normal(size=(rows, cols)) * np.logspace(-3, 1, rows)[:, None]
    w[: rows // 4] = np.abs(w[: rows // 4]) + 0.5  # all-positive blocks: Q4_1's min is > 0
    stored = gguf.quants.quantize(w.astype(np.float32), Q[kind])
    return open_gguf(write_gguf(tmp_path / f"{kind}.gguf", {"w": (stored, Q[kind])})).tensors[0]


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_blocks_dequantize_exactly(tmp_path: Path, kind: str) -> None:
    tensor = synthetic(tmp_path, kind)
    packed = read_packed(tensor)
    assert packed.kind == kind and packed.scales.dtype == torch.float16 and packed.scales.shape == (48, 3)
    assert packed.qweight.shape == ((48, 96) if kind == "Q8_0" else (48, 48))
    assert (packed.mins is not None) == (kind == "Q4_1")
    ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(48, 96))
    assert torch.equal(packed.dequantize(), ref)  # bit for bit, float32
    assert torch.equal(dequantize(tensor, "t"), ref)


def test_smollm2_tensors_dequantize_exactly(smollm2_path: Path) -> None:
    tensors = {t.name: t for t in open_gguf(smollm2_path).tensors}
    for name in ("token_embd.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight"):
        tensor = tensors[name]
        assert tensor.tensor_type.name == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
        assert torch.equal(read_packed(tensor).dequantize(), dequantize(tensor, str(smollm2_path))), name


def test_row_permutation_and_fusion_are_exact(tmp_path: Path) -> None:
    a, b = read_packed(synthetic(tmp_path, "Q4_1")), read_packed(synthetic(tmp_path, "Q4_1", rows=16))
    permuted = a.map_rows(lambda t: unpermute_qk(t, 4))
    assert torch.equal(permuted.dequantize(), unpermute_qk(a.dequantize(), 4))
    assert torch.equal(PackedWeight.cat([permuted, b]).dequantize(), torch.cat([permuted.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot fuse"):
        PackedWeight.cat([a, read_packed(synthetic(tmp_path, "Q4_0"))])


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_matmuls_match_dequantized(tmp_path: Path, kind: str) -> None:
    packed = read_packed(synthetic(tmp_path, kind))
    deq, bias = packed.dequantize(), torch.randn(48)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    ref = x @ deq.T + bias
    fp32 = packed.to_linear(bias, torch.float32, torch.device("cpu"))
    assert fp32.kernel == "dequantize" and fp32.scales.dtype == torch.float16
    torch.testing.assert_close(fp32(x), ref, rtol=1e-5, atol=1e-5)
    bf16 = packed.to_linear(bias, torch.bfloat16, torch.device("cpu"))
    assert bf16.kernel == ("dequantize" if kind == "Q8_0" else "weight_int4pack_mm_for_cpu")
    out = bf16(x.bfloat16()).float()
    assert ((out - ref).norm() / ref.norm()) < 1e-2
    if kind == "Q8_0":  # dequantized in float32, then rounded once: the bf16 dequantized model's weights
        torch.testing.assert_close(out, (torch.nn.functional.linear(x.bfloat16(), deq.bfloat16()) + bias.bfloat16())
                                   .float(), rtol=0, atol=0)
    else:  # tinygemm's float offset (m + 8 s) carries Q4_1's min; float32 shows it is exact up to rounding
        tiny = Int4Linear(packed.qweight, packed.scales, None, mins=packed.mins, kernel="weight_int4pack_mm_for_cpu")
        torch.testing.assert_close(tiny(x), x @ deq.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tiny.dequantized_weight(), deq, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_triton_kernels_on_gguf_formats(tmp_path: Path, dtype: torch.dtype, kind: str) -> None:
    device = "cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda"
    packed = read_packed(synthetic(tmp_path, kind))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    q, s = packed.qweight.to(device), packed.scales.to(device)
    out = torch.full((3, 48), float("nan"), dtype=dtype, device=device)
    if kind == "Q8_0":
        quant_gemm.w8a16_gemm(x, q, s, out=out)
        ref = quant_gemm.w8a16_gemm_ref(x, q, s)
    else:
        mins = None if packed.mins is None else packed.mins.to(device)
        quant_gemm.w4a16_gemm(x, q, s, None, 32, mins=mins, out=out)
        ref = quant_gemm.w4a16_gemm_ref(x, q, s, None, 32, mins=mins)
    expected = (x.float() @ packed.dequantize().to(device).T).to(dtype)
    torch.testing.assert_close(ref.float().cpu(), expected.float().cpu())
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err <= (1e-3 if dtype == torch.float32 else 1e-2)


def tiny_logits(model, ids: torch.Tensor) -> torch.Tensor:
    set_context(prefill_context([len(ids)]))
    try:
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(len(ids))))
    finally:
        reset_context()


def test_tiny_llama_mixed_types_load_packed(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # Layer 0 mixes types inside qkv_proj (dequantized); layer 1 packs q/k/v (llama.cpp-permuted rows).
    types = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_0,
             "blk.0.attn_v.weight": Q.Q8_0}
    for layer in (0, 1):
        types.update({f"blk.{layer}.attn_output.weight": Q.Q4_1, f"blk.{layer}.ffn_gate.weight": Q.Q8_0,
                      f"blk.{layer}.ffn_up.weight": Q.Q8_0, f"blk.{layer}.ffn_down.weight": Q.Q4_0})
    types.update({f"blk.1.attn_{p}.weight": Q.Q4_1 for p in "qkv"})
    path = write_gguf_like_llama_cpp(tiny_llama_dir, tmp_path / "tiny.gguf", types)
    packed = load_model(Config(model=str(path), dtype="float32", device="cpu", gguf_dequantize=False))
    plain = load_model(Config(model=str(path), dtype="float32", device="cpu", gguf_dequantize=True))
    layers = packed.model.model.layers
    assert not isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(layers[1].self_attn.qkv_proj, Int4Linear) and layers[1].self_attn.qkv_proj.mins is not None
    assert isinstance(layers[0].mlp.gate_up_proj, Int8Linear) and layers[0].mlp.gate_up_proj.group_size == 32
    assert isinstance(layers[0].mlp.down_proj, Int4Linear) and layers[0].mlp.down_proj.zeros is None
    assert packed.model.model.embed_tokens.weight.dtype == torch.float32  # embeddings stay float
    assert not any(isinstance(m, QuantLinear) for m in plain.model.modules())
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(0))
    # float32 packed modules dequantize to the very weights the plain load holds
    torch.testing.assert_close(tiny_logits(packed.model, ids), tiny_logits(plain.model, ids), rtol=1e-6, atol=1e-6)
    # By default on a bf16 CPU only the int4 types stay packed: Q8_0's per-block scales have no
    # packed CPU matmul, and dequantizing them at every matmul made a decode row 5-10x slower.
    default = load_model(Config(model=str(path), dtype="bfloat16", device="cpu")).model.model.layers
    assert not isinstance(default[0].mlp.gate_up_proj, QuantLinear) and default[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    assert isinstance(default[0].mlp.down_proj, Int4Linear) and isinstance(default[1].self_attn.qkv_proj, Int4Linear)
    torch.testing.assert_close(default[0].mlp.gate_up_proj.weight, plain.model.model.layers[0].mlp.gate_up_proj.weight
                               .bfloat16(), rtol=0, atol=0)
    asked = load_model(Config(model=str(path), dtype="float32", device="cpu", quantization="int8"))
    requantized = [m for m in asked.model.modules() if isinstance(m, Int8Linear)]
    assert requantized and all(m.group_size is None for m in requantized)  # per-channel, not Q8_0's groups


def test_packed_projections_that_disagree_with_the_config_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Served packed, the projections were built from the file's own shapes and never checked:
    feed_forward_length 96 against 128-row tensors loaded, and answered garbage."""
    import json
    import shutil
    folder = tmp_path / "lying"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))  # the metadata only
    types = {f"blk.{layer}.ffn_{part}.weight": Q.Q8_0 for layer in (0, 1) for part in ("gate", "up", "down")}
    path = write_gguf_like_llama_cpp(folder, tmp_path / "lying.gguf", types)
    for dequantized in (False, True):
        # Refused before any model is built from the metadata (GGUF sizes against the tensors).
        with pytest.raises(ModelLoadError, match=r"lying\.gguf: GGUF metadata llama\.feed_forward_length is 96, "
                                                 r"the tensors hold 128"):
            load_model(Config(model=str(path), dtype="float32", device="cpu", gguf_dequantize=dequantized))


def decoder_weight_count(model: torch.nn.Module) -> int:
    """Weights in the decoder projections (qkv_proj, o_proj, gate_up_proj, down_proj), packed or float."""
    return sum(m.in_features * m.out_features if isinstance(m, QuantLinear) else m.weight.numel()
               for name, m in model.named_modules() if name.endswith("_proj"))


def test_smollm2_q4_1_served_packed_matches_dequantized_greedy(smollm2_path: Path) -> None:
    from kiln.engine.llm import LLM
    from kiln.engine.sampling_params import SamplingParams
    prompts = ["The capital of France is", "Once upon a time, there was a", "def fibonacci(n):",
               "The three primary colors are", "Water boils at", "My favourite book is",
               "In 1969, the first man on the Moon", "To make a cup of tea, first"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens, bits = {}, {}
    for dequantized in (False, True):
        llm = LLM(str(smollm2_path), dtype="float32", device="cpu", kv_cache_memory=1 << 24, max_model_len=256,
                  gguf_dequantize=dequantized)
        tokens[dequantized] = [o.token_ids for o in llm.generate(prompts, params)]
        model = llm.engine.runner.model
        bits[dequantized] = resident_weight_bytes(model, linears_only=True) * 8 / decoder_weight_count(model)
        del llm
    print("bits per decoder-linear weight (packed, dequantized float32):", bits[False], bits[True])
    assert tokens[False] == tokens[True]
    assert all(len(t) == 24 for t in tokens[False])
    assert 4.5 <= bits[False] <= 5.05 and bits[True] == 32


def test_serve_and_generate_take_gguf_dequantize() -> None:
    import argparse

    from kiln.engine import cli, server
    for module in (server, cli):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        extra = ["--prompt", "x"] if module is cli else []
        assert parser.parse_args(["--gguf-dequantize", *extra]).gguf_dequantize is True
        assert parser.parse_args(["--no-gguf-dequantize", *extra]).gguf_dequantize is False
        assert parser.parse_args(extra).gguf_dequantize is None


def test_gguf_packed_by_default_where_a_packed_matmul_exists() -> None:
    from kiln.engine.config import Config
    assert Config(dtype="bfloat16", device="cpu").keeps_gguf_packed
    assert not Config(dtype="float32", device="cpu").keeps_gguf_packed  # dequantize-per-matmul is ~8x slower
    assert Config(dtype="float32", device="cpu", gguf_dequantize=False).keeps_gguf_packed
    assert not Config(dtype="bfloat16", device="cpu", gguf_dequantize=True).keeps_gguf_packed
    assert not Config(dtype="bfloat16", device="cpu", quantization="int8").keeps_gguf_packed
    assert Config(dtype="bfloat16", device="cpu").gguf_packed_types == ("Q4_0", "Q4_1")
    assert Config(dtype="float32", device="cpu", gguf_dequantize=False).gguf_packed_types == ("Q8_0", "Q4_0", "Q4_1")
    assert Config(dtype="float32", device="cpu").gguf_packed_types == ()
