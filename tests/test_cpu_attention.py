"""The fused CPU paged-attention op (kiln.engine.cpu_attention, csrc/paged_attention_cpu.cpp)
against the torch path it replaces: mixed decode + chunked-prefill batches, GQA, fp32/bf16,
block sizes 16/32, contexts split across threads; the build cache; the fallback when the op
cannot build; bad input; and SmolLM2's greedy tokens under both backends."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.engine import LLM, SamplingParams, cpu_attention, cpu_library
from kiln.engine.attention import paged_attention as torch_paged_attention
from kiln.engine.config import Config
from kiln.engine.kv_quant import quantize_kv
from test_engine_generate import PROMPTS

HQ, HKV, D = 6, 2, 64  # GQA: three query heads per KV head
# (query tokens, context length) per sequence: decodes (short, exactly a block, long), a chunked
# prefill over a cached prefix, a plain prefill, and a sequence with no query token this step.
MIXED = [(1, 1), (1, 32), (1, 300), (20, 100), (37, 37), (1, 77), (0, 40), (5, 5), (64, 200)]


@pytest.fixture(scope="module", autouse=True)
def op_built() -> None:
    assert cpu_library.available(), cpu_library.unavailable_reason()


def make_batch(shape: list[tuple[int, int]], block_size: int, dtype: torch.dtype, seed: int = 0,
               hq: int = HQ, hkv: int = HKV, d: int = D) -> dict:
    """A random paged cache and a varlen batch over it; blocks are handed out shuffled, so a
    sequence's blocks are not contiguous in the pool, and the spare ones hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in shape]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(shape), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for b, ((_, ctx), nblocks) in enumerate(zip(shape, blocks_per_seq)):
        ids = order[used:used + nblocks]
        used += nblocks
        tables[b, :nblocks] = ids.to(torch.int32)
        slots = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
        k_cache.view(-1, hkv, d)[slots] = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        v_cache.view(-1, hkv, d)[slots] = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
    q_lens = torch.tensor([n for n, _ in shape], dtype=torch.int32)
    cu = torch.zeros(len(shape) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(q_lens, 0)
    return dict(q=torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype), k_cache=k_cache, v_cache=v_cache,
                cu_seqlens_q=cu, seq_lens=torch.tensor([c for _, c in shape], dtype=torch.int32),
                block_tables=tables, scale=d ** -0.5, max_seqlen_q=int(q_lens.max()),
                max_seqlen_k=max(c for _, c in shape))


def reference(batch: dict) -> torch.Tensor:
    """The torch path on fp32 copies: the exact answer a bf16 op is held to."""
    as_fp32 = {k: v.float() if k in ("q", "k_cache", "v_cache") else v for k, v in batch.items()}
    return torch_paged_attention(**as_fp32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("partition_size", [0, 32, 96])  # 0: the op's choice; else splits of 1-3 blocks
@pytest.mark.parametrize("sdpa_above", [16, 1 << 30])  # the default split with SDPA; the op alone
def test_op_equals_torch_path(dtype: torch.dtype, block_size: int, partition_size: int, sdpa_above: int) -> None:
    batch = make_batch(MIXED, block_size, dtype)
    out = cpu_attention.paged_attention(**batch, partition_size=partition_size, sdpa_above=sdpa_above)
    ref = reference(batch)
    torch_out = torch_paged_attention(**batch)  # the torch path in the same dtype, for scale
    err, torch_err = (out.float() - ref).abs().max().item(), (torch_out.float() - ref).abs().max().item()
    print(f"{dtype} block {block_size} partition {partition_size} sdpa_above {sdpa_above}: max |op - ref| {err:.2e}, "
          f"torch path in {dtype} {torch_err:.2e}")
    assert out.dtype == dtype and out.shape == batch["q"].shape
    assert not out.isnan().any()
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2  # bf16: a few ulps of outputs near 1
    assert err < tol
    assert err <= 2 * torch_err + 2e-6  # no worse than the torch path it replaces
    # The model's q is a view into the fused qkv projection: strided rows, contiguous heads.
    fused = torch.cat([batch["q"], torch.zeros_like(batch["q"])], dim=1)
    strided = cpu_attention.paged_attention(**{**batch, "q": fused[:, :HQ]}, partition_size=partition_size,
                                            sdpa_above=sdpa_above)
    assert torch.equal(strided, out)


def test_long_context_split_across_threads() -> None:
    """One sequence, one KV head: fewer (sequence, head) pairs than threads, so the op splits its
    2000 keys by itself; the merged result equals the unsplit one and the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = make_batch([(1, 2000), (3, 1500)], 16, torch.float32, seed=3, hq=4, hkv=1)
        auto = cpu_attention.paged_attention(**batch)
        unsplit = cpu_attention.paged_attention(**batch, partition_size=1 << 20)
        split = cpu_attention.paged_attention(**batch, partition_size=16)  # 125 splits of one block
    finally:
        torch.set_num_threads(before)
    ref = reference(batch)
    errs = [(o - ref).abs().max().item() for o in (auto, unsplit, split)]
    print(f"2000-key context: max error auto {errs[0]:.2e}, unsplit {errs[1]:.2e}, 125 splits {errs[2]:.2e}")
    assert max(errs) < 2e-5


@pytest.mark.parametrize("d", [h for h in cpu_attention.HEAD_DIMS if h != D])
def test_other_head_sizes(d: int) -> None:
    """Every head size the op is compiled for (64 is the tests' above), with 2 and 12 query heads a
    KV head (more than one register pass of rows), in bf16."""
    for hq, hkv in ((4, 2), (12, 1)):
        batch = make_batch(MIXED, 16, torch.bfloat16, seed=d, hq=hq, hkv=hkv, d=d)
        err = (cpu_attention.paged_attention(**batch).float() - reference(batch)).abs().max().item()
        print(f"head_dim {d}, {hq // hkv} query heads a KV head: max |op - ref| {err:.2e}")
        assert err < 1.6e-2


def test_unsupported_head_size_runs_torch_backend(tmp_path) -> None:
    """A model whose head_dim (8) the op is not compiled for: "auto" runs it on the torch backend
    with the same tokens; "cpu" by name is a clear error; the op itself refuses such a q."""
    from kiln.engine.config import ModelLoadError
    from tiny_models import write_tiny_model
    folder = write_tiny_model("llama", tmp_path / "tiny", hidden_size=32)  # 4 heads of 8
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("auto", "torch"):
        llm = LLM(model=str(folder), dtype="float32", attention_backend=backend)
        assert {a.backend.name for a in llm.engine.runner._attention_layers()} == {"torch"}
        outs[backend] = [o.token_ids for o in llm.generate(["w3 w4 w5"], params)]
    assert outs["auto"] == outs["torch"] and len(outs["auto"][0]) == 6
    with pytest.raises(ModelLoadError, match="head_dim 8"):
        LLM(model=str(folder), dtype="float32", attention_backend="cpu")
    batch = make_batch([(1, 20)], 16, torch.float32, d=48)
    with pytest.raises(RuntimeError, match="head_dim 48 is not one the op is built for"):
        cpu_attention.paged_attention(**batch)


def test_quantized_cache_takes_torch_path() -> None:
    """An int8 cache is not read by the op: the wrapper hands it to the torch path, whose answer it returns."""
    batch = make_batch([(1, 50), (8, 40)], 16, torch.float32, seed=5)
    k, ks = quantize_kv(torch.nan_to_num(batch["k_cache"]), torch.int8)
    v, vs = quantize_kv(torch.nan_to_num(batch["v_cache"]), torch.int8)
    quantized = {**batch, "k_cache": k, "v_cache": v}
    out = cpu_attention.paged_attention(**quantized, k_scales=ks, v_scales=vs)
    assert torch.equal(out, torch_paged_attention(**quantized, k_scales=ks, v_scales=vs))
    assert (out - reference(batch)).abs().max().item() < 0.1  # int8 rounding, not garbage


def test_bad_input_is_a_clear_error() -> None:
    batch = make_batch([(1, 40), (4, 20)], 16, torch.float32)
    cases = [
        ({"block_tables": batch["block_tables"].long()}, "int32"),
        ({"k_cache": batch["k_cache"].half()}, "share a float dtype"),
        ({"q": torch.randn(5, 5, D)}, "multiple of KV heads"),
        ({"seq_lens": torch.tensor([40, 3], dtype=torch.int32)}, "4 query tokens but a context of 3"),
        ({"seq_lens": torch.tensor([90, 20], dtype=torch.int32)}, "needs 6 blocks but block_tables has 3"),
        ({"block_tables": torch.tensor([[0, 1, 99], [2, 0, 0]], dtype=torch.int32)}, "outside the pool"),
        ({"cu_seqlens_q": torch.tensor([0, 1, 4], dtype=torch.int32)}, "from 0 to N = 5"),
    ]
    for change, message in cases:
        with pytest.raises(RuntimeError, match=message):
            cpu_attention.paged_attention(**{**batch, **change})


def test_cached_build_is_reused() -> None:
    """A second process finds the built library under ~/.cache/kiln/ops and loads it without building."""
    library = cpu_library.build_dir() / "kiln_cpu_ops.so"
    built = library.stat().st_mtime_ns
    code = "from kiln.engine import cpu_library as c; assert c.available()"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert library.stat().st_mtime_ns == built  # loaded, not rebuilt


def test_a_library_cut_short_mid_link_is_linked_again(tmp_path) -> None:
    """A build killed while linking (OOM, eviction) left a partial .so: only its existence was
    checked, and its dlopen died of SIGBUS in every process using that cache, with no fallback."""
    import shutil
    assert cpu_library.available()
    folder = tmp_path / "ops" / cpu_library.build_dir().name  # this build's folder under KILN_CACHE=tmp_path
    shutil.copytree(cpu_library.build_dir(), folder)  # its objects too: only the link is redone
    library = folder / "kiln_cpu_ops.so"
    library.write_bytes(library.read_bytes()[:library.stat().st_size // 3])  # the link cut short
    (folder / "built").unlink(missing_ok=True)
    code = "from kiln.engine import cpu_library as c; assert c.available(), c.unavailable_reason()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KILN_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]  # was -7: SIGBUS
    assert (folder / "built").exists() and library.stat().st_size == cpu_library.build_dir().joinpath(
        "kiln_cpu_ops.so").stat().st_size


def test_a_lock_file_left_by_a_killed_build_is_not_waited_on(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's FileBaton (before its file lock) builds while a `lock` file exists and deletes it when
    done: a build killed mid-way (OOM, eviction) left it, and every later start waited on it forever."""
    import torch.utils.cpp_extension
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_library, "_state", {})
    folder = cpu_library.build_dir()
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what the killed build left

    def load(build_directory: str, **_: object) -> None:  # FileBaton.wait, failing where it waits forever
        if (Path(build_directory) / "lock").exists():
            raise TimeoutError("waits on the lock file forever")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    assert cpu_library.available(), cpu_library.unavailable_reason()


def test_failed_build_falls_back_to_torch(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """A source the real compiler rejects: "auto" logs why once and runs the torch path; an
    explicit "cpu" is a clear error."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_library, "SOURCES", [broken])
    monkeypatch.setattr(cpu_library, "_state", {})
    assert not cpu_library.available()
    assert not cpu_library.available()  # the second call does not rebuild or log again
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    print("logged:", warnings[0].getMessage()[:200])
    assert len(warnings) == 1
    assert Config(device="cpu").resolved_attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu' could not build its op"):
        Config(device="cpu", attention_backend="cpu").resolved_attention_backend


def test_backend_choice(monkeypatch) -> None:
    assert Config(device="cpu").resolved_attention_backend == "cpu"
    assert Config(device="cpu", attention_backend="torch").resolved_attention_backend == "torch"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # as on a GPU machine
    with pytest.raises(ValueError, match="needs a CPU device"):
        Config(device="cuda", attention_backend="cpu").resolved_attention_backend
    monkeypatch.undo()
    for device, message in (("cuda:64", "this machine has|this process sees no CUDA device"),
                            ("meta", "device must be auto, cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=message):  # said at once, not by a driver once loading began
            Config(device=device)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        Config(attention_backend="onednn")


def test_smollm2_greedy_tokens_identical() -> None:
    """The engine-core prompts, 16-token chunks so prefill chunks run beside decodes, then a
    prefix-cache hit: the same greedy tokens from the op and the torch path."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared two-core machine: see test_engine_generate's one_thread
    try:
        tokens, seconds = {}, {}
        for backend in ("torch", "cpu"):
            llm = LLM(dtype="float32", attention_backend=backend, max_num_batched_tokens=16, max_model_len=256)
            assert {a.backend.name for a in llm.engine.runner._attention_layers()} == {backend}
            start = time.perf_counter()
            outs = llm.generate(PROMPTS, params) + llm.generate([PROMPTS[2] + " and"], params)
            seconds[backend] = time.perf_counter() - start
            tokens[backend] = [o.token_ids for o in outs]
            del llm
    finally:
        torch.set_num_threads(before)
    print(f"greedy over {len(tokens['cpu'])} prompts: torch path {seconds['torch']:.2f} s, "
          f"cpu op {seconds['cpu']:.2f} s")
    assert all(len(t) == 12 for t in tokens["cpu"])
    assert tokens["cpu"] == tokens["torch"]
