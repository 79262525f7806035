"""Write a bf16 GGUF from a (quantized) GGUF: every tensor dequantized exactly as Kiln's loader
does it, then rounded to bf16, so Kiln and llama.cpp serve identical weights in one precision.

    python bench/bf16_gguf.py [--model smollm2-135m] --out model.bf16.gguf
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import torch

from kiln.engine.gguf_loader import dequantize
from kiln.engine.loader import resolve_model_path


def write_bf16_gguf(src: Path, out: Path) -> Path:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        # The writer adds GGUF.* and the architecture itself; file_type changes below.
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for tensor in reader.tensors:
        weights = dequantize(tensor, str(src)).to(torch.bfloat16)
        if weights.dim() == 1:  # llama.cpp wants norms in F32; these hold the bf16-rounded values
            writer.add_tensor(tensor.name, weights.float().numpy())
        else:
            raw = weights.view(torch.int16).numpy().view("uint8")  # bf16 bytes, GGUF layout unchanged
            writer.add_tensor(tensor.name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_bf16_gguf(resolve_model_path(args.model), args.out))


if __name__ == "__main__":
    main()
