"""The `wide` model type for lm-evaluation-harness: HFLM running a base model with WIDE routers.

    lm_eval --model wide --model_args pretrained=smollm2-135m,routers=DIR,dtype=bfloat16 ...
    (through `python -m wide.eval.lm_eval_cli`, which registers the type and the offline tasks;
    lm-eval 0.4.13 has no plugin entry point for models)

`pretrained` goes through `wide.model.load_model` ("smollm2-135m" = the embedded GGUF, else a local
path or hub id). `routers` (optional) is a router checkpoint; when it also holds a PEFT LoRA adapter
(`adapter_config.json`), the adapter is loaded and merged before the routers are attached.

Sparsity: the meter counts every token lm-eval feeds the model except right padding. HFLM pads each
batch on the right (`pad_and_concat`); while `_loglikelihood_tokens` runs, this class records the true
input lengths given to `pad_and_concat` and sets the [B, T] token mask before each forward. Forwards
with unknown lengths (batch-size probing with batch_size=auto) are not counted. The summary is in
`results["config"]["wide_sparsity"]` (via `get_model_info`) and `WideLM.sparsity()`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from lm_eval.api.registry import register_model
from lm_eval.models import huggingface as _hf
from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_routed(
    pretrained: str = "smollm2-135m",
    routers: str | None = None,
    *,
    dtype: str | torch.dtype | None = "float32",
    device: str | None = None,
    strict_base: bool = True,
):
    """(model, tokenizer, wide_model or None): base model on device, LoRA merged, routers attached."""
    from wide.baselines import load as load_method
    from wide.model import load_model

    model, tok = load_model(pretrained, dtype=parse_dtype(dtype), device=device or default_device())
    wm = None
    if routers:
        rdir = Path(routers)
        if not rdir.is_dir():
            raise FileNotFoundError(f"router checkpoint {rdir} does not exist")
        # any method of wide.baselines; a stage-2 checkpoint's LoRA adapter is merged into model first
        wm = load_method(model, str(rdir), strict_base=strict_base)
        wm.eval()
    return model, tok, wm


@register_model("wide")
class WideLM(HFLM):
    """HFLM over a (routed) WIDE model. Extra model_args: `routers`, `strict_base`."""

    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        routers: str | None = None,
        dtype: str | torch.dtype | None = "float32",
        device: str | None = None,
        strict_base: bool = True,
        model=None,
        tokenizer=None,
        wide_model=None,
        **kwargs,
    ) -> None:
        if model is None:
            model, tokenizer, wide_model = load_routed(
                str(pretrained), routers or None, dtype=dtype, device=device, strict_base=_as_bool(strict_base)
            )
        self.wide = wide_model
        self.wide_name = str(pretrained)
        self.routers_dir = routers or None
        self._lengths: list[int] | None = None
        if self.wide is not None:
            self.wide.start_meter()
        kwargs.pop("backend", None)
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **kwargs)

    # ----------------------------------------------------------------- sparsity accounting
    @contextmanager
    def _record_lengths(self):
        original = _hf.pad_and_concat

        def recording(max_length, tensors, padding_side="right"):
            self._lengths = [int(t.shape[-1]) for t in tensors]
            return original(max_length, tensors, padding_side=padding_side)

        _hf.pad_and_concat = recording
        try:
            yield
        finally:
            _hf.pad_and_concat = original
            self._lengths = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        with self._record_lengths():
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    def _set_token_mask(self, inps: torch.Tensor) -> None:
        """The [B, T] real-token mask of the batch about to run, for the sparsity meter."""
        if self.wide is None:
            return
        b, t = inps.shape
        lengths = self._lengths
        if lengths is not None and len(lengths) == b:
            mask = torch.arange(t, device=inps.device)[None, :] < torch.tensor(lengths, device=inps.device)[:, None]
        else:  # unknown lengths (batch-size probing): count nothing
            mask = torch.zeros(b, t, dtype=torch.bool, device=inps.device)
        self.wide.meter.set_token_mask(mask)  # [B, T]
        self._lengths = None

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        self._set_token_mask(inps)
        return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    def sparsity(self) -> dict | None:
        """The meter's summary over everything evaluated so far (None when dense)."""
        return None if self.wide is None else self.wide.meter.summary()

    def get_model_info(self) -> dict:
        info = {
            "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
            "model_dtype": str(self._model.dtype),
            "wide_pretrained": self.wide_name,
            "wide_routers": self.routers_dir,
        }
        if self.wide is not None:
            info["wide_sparsity"] = self.sparsity()
            log.info("WIDE real sparsity: %s", {k: v for k, v in info["wide_sparsity"].items() if k != "per_layer"})
        return info


def _as_bool(x) -> bool:
    return x if isinstance(x, bool) else str(x).lower() not in ("0", "false", "no")


class RuntimeLM(WideLM):
    """WideLM whose forwards run through a ``wide.runtime.WideRuntime`` (the served kernels) instead of
    the masked Hugging Face path. Built by ``wide.eval.runner.run_eval(runtime=True)``; the runtime must
    have been built over ``model`` with max_batch >= batch_size and max_seq >= max_length. The meter
    counts the runtime's own decisions."""

    def __init__(self, *args, runtime, **kwargs) -> None:
        self.runtime = runtime
        super().__init__(*args, **kwargs)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        self._set_token_mask(inps)
        return self.runtime.score(inps)


class RuntimeScorer:
    """``model(ids).logits`` over a WideRuntime, for `wide.eval.perplexity` (right-padded batches)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime

    def parameters(self):
        return self.runtime.hf.parameters()

    def __call__(self, ids: torch.Tensor):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.runtime.score(ids))
