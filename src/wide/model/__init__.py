"""Routing on Hugging Face models: loading, the in-place WideModel adapter and router checkpoints."""

from wide.model.checkpoint import CheckpointMismatchError, load_routers, read_checkpoint_meta, save_routers
from wide.model.loading import SMOLLM2, check_context, load_model, resolve_model_id, save_tiny_llama, smollm2_gguf_path
from wide.model.wide_model import SUPPORTED_FAMILIES, UnsupportedModelError, WideModel, decoder_layers

__all__ = [
    "SMOLLM2",
    "SUPPORTED_FAMILIES",
    "CheckpointMismatchError",
    "UnsupportedModelError",
    "WideModel",
    "check_context",
    "decoder_layers",
    "load_model",
    "load_routers",
    "read_checkpoint_meta",
    "resolve_model_id",
    "save_routers",
    "save_tiny_llama",
    "smollm2_gguf_path",
]
