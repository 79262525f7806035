"""The sampling a model's authors recommend: its generation_config.json's temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens become the server's defaults for requests
that leave them out, as vLLM's `--generation-config auto` does (Llama 3 Instruct ships
temperature 0.6 and top_p 0.9; OpenAI's defaults of 1.0 sample it hotter than meant).
`--generation-config vllm` keeps the API's own defaults; a folder takes that folder's file."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from kiln.engine.config import GENERATION_CONFIG
from kiln.engine.openai_protocol import ChatCompletionRequest

# generation_config.json's key -> the request field it is the default of
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(choice: str, model_path: Path) -> dict[str, float | int]:
    """The request defaults `--generation-config choice` gives (request field -> value): "auto"
    reads the model's folder (a GGUF file has none), "vllm" gives none, else choice is a folder
    holding generation_config.json. A ValueError names a missing file or a value out of range."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        path = model_path / GENERATION_CONFIG
        if not path.is_file():
            return {}
    else:
        path = Path(choice) / GENERATION_CONFIG
        if not path.is_file():
            raise ValueError(f"--generation-config {choice}: no {GENERATION_CONFIG} there (give a folder holding one, "
                             "'auto' for the model's own or 'vllm' for none)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    defaults = {field: raw[key] for key, field in KEYS.items() if raw.get(key) is not None}
    try:  # within the bounds a request's own values must keep, and of their types (top_k 2.0 is 2)
        checked = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "-"}], **defaults})
    except ValidationError as e:
        problems = "; ".join(f"{next(k for k, f in KEYS.items() if f == err['loc'][0])}: {err['msg']}"
                             for err in e.errors())
        raise ValueError(f"{path}: {problems} (--generation-config vllm ignores the file)") from None
    return {field: getattr(checked, field) for field in defaults}
