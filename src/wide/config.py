"""WideConfig: the routing hyper-parameters, validated against a model and serialisable to JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROUTER_INPUTS = ("normed", "residual")
FFN_ROUTER_SOURCES = ("block", "layer")
# Methods a router checkpoint can hold (docs/baselines.md): WIDE itself, the token-wise depth baselines,
# and the training-free width baselines (wide.baselines).
METHODS = ("wide", "module-skip", "layer-skip", "static-width", "teal")
# Methods without a router per block and group: layer skipping ties the FFN's decision to the attention's, TEAL
# thresholds activations. The runtime serves the others only (wide.runtime.WideRuntime).
NO_GROUP_ROUTERS = ("layer-skip", "teal")
SPARSITY_KINDS = ("groups", "flops")
DISTILL = ("none", "kl", "kl+lm")


class WideConfigError(ValueError):
    """A configuration that cannot be applied to the model at hand."""


@dataclass(frozen=True)
class ModelDims:
    """The dimensions of a decoder that routing depends on."""

    n_layers: int
    hidden: int  # D
    n_q_heads: int  # Hq
    n_kv_heads: int  # Hk
    head_dim: int  # d
    intermediate: int  # D'
    vocab: int

    @property
    def gqa_group(self) -> int:
        """Query heads sharing one KV head (Hq / Hk)."""
        return self.n_q_heads // self.n_kv_heads

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelDims:
        hq = cfg.num_attention_heads
        hk = getattr(cfg, "num_key_value_heads", None) or hq
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
        return cls(
            n_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            n_q_heads=hq,
            n_kv_heads=hk,
            head_dim=head_dim,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
        )


@dataclass(frozen=True)
class RoutingShape:
    """What the routers of one model look like under a config."""

    attn_heads_per_group: int  # query heads per attention decision
    attn_groups: int  # N_G for attention = Hq / heads_per_group
    ffn_group_size: int  # channels per FFN decision
    ffn_groups: int  # N_G for FFN = D' / G_ffn
    gqa_aligned: bool


@dataclass
class WideConfig:
    """Routing hyper-parameters (paper §3.1–3.2).

    attn_group_size: query heads per attention decision; None means Hq/Hk (one GQA group).
    ffn_group_size: intermediate channels per FFN decision (a power of two >= 16 dividing D').
    sparsity: shared target S; attn_sparsity / ffn_sparsity (both set) switch to the uniform
        loss of paper eq. 22 with separate targets.
    router_input: "normed" routes on the normalised hidden state entering attention / FFN,
        "residual" on the residual stream (as the authors' code does).
    ffn_router_source: "block" — the FFN router reads the FFN block's input (the paper); "layer" — it reads
        the layer's input, as the attention router does, so both decisions are known when the layer starts
        and the FFN router can run beside attention (docs/kernels.md, open problems).
    module_skipping: the SkipGPT-style baseline — one decision per token for the whole attention
        block and one for the whole FFN (group sizes are then ignored). Same as method="module-skip".
    method: "wide", or a baseline of docs/baselines.md: "module-skip", "layer-skip" (one decision
        per token per layer for attention + FFN together), "static-width" (fixed group masks from
        calibration activations), "teal" (per-layer activation magnitude thresholds).
    sparsity_kind: what the target S measures — "groups" (the fraction of routing groups skipped,
        paper eq. 6; activations zeroed for teal) or "flops" (the fraction of the forward's FLOPs
        removed, as `wide.accounting` counts them; shared target only).
    distill: the calibration objective — "none" (LM loss), "kl" (KL to the frozen dense model's
        next-token distribution instead), "kl+lm" (both).
    seed: the routers' initialisation (`wide.train.calibrate.seeded_wide_model`; `wide calibrate
        --seed` sets it and the data order / Gumbel noise seed alike): equal seeds, equal routers.
    """

    attn_group_size: int | None = None
    ffn_group_size: int = 128
    router_rank: int = 32
    sparsity: float = 0.5
    attn_sparsity: float | None = None
    ffn_sparsity: float | None = None
    alpha: float = 20.0
    tau_start: float = 5.0
    tau_end: float = 0.5
    router_input: Literal["normed", "residual"] = "normed"
    ffn_router_source: Literal["block", "layer"] = "block"
    module_skipping: bool = False
    method: str = "wide"
    sparsity_kind: str = "groups"
    distill: str = "none"
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # module_skipping is the older spelling of method="module-skip": keep the two in step
        if self.module_skipping and self.method == "wide":
            self.method = "module-skip"
        if self.method == "module-skip":
            self.module_skipping = True
        self.validate()

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        # every float is checked with math.isfinite first: NaN fails no comparison and inf passes "> 0"
        def frac(name: str, v: float | None) -> None:
            if v is not None and not (math.isfinite(v) and 0.0 <= v < 1.0):
                raise WideConfigError(f"{name} must be in [0, 1), got {v}")

        frac("sparsity", self.sparsity)
        frac("attn_sparsity", self.attn_sparsity)
        frac("ffn_sparsity", self.ffn_sparsity)
        if (self.attn_sparsity is None) != (self.ffn_sparsity is None):
            raise WideConfigError("set both attn_sparsity and ffn_sparsity, or neither")
        if self.router_rank < 1:
            raise WideConfigError(f"router_rank must be >= 1, got {self.router_rank}")
        g = self.ffn_group_size
        if g < 16 or g & (g - 1):
            raise WideConfigError(f"ffn_group_size must be a power of two >= 16, got {g}")
        if self.attn_group_size is not None and self.attn_group_size < 1:
            raise WideConfigError(f"attn_group_size must be >= 1 query head, got {self.attn_group_size}")
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise WideConfigError(f"alpha must be a finite number >= 0, got {self.alpha}")
        for name in ("tau_start", "tau_end"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise WideConfigError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.router_input not in ROUTER_INPUTS:
            raise WideConfigError(f"router_input must be one of {ROUTER_INPUTS}, got {self.router_input!r}")
        if self.ffn_router_source not in FFN_ROUTER_SOURCES:
            raise WideConfigError(
                f"ffn_router_source must be one of {FFN_ROUTER_SOURCES}, got {self.ffn_router_source!r}"
            )
        if self.ffn_router_source == "layer" and self.method in NO_GROUP_ROUTERS:
            raise WideConfigError(f"ffn_router_source='layer' needs an FFN router of its own; {self.method} has none")
        if self.method not in METHODS:
            raise WideConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.module_skipping and self.method != "module-skip":
            raise WideConfigError(f"module_skipping=True contradicts method={self.method!r}")
        if self.sparsity_kind not in SPARSITY_KINDS:
            raise WideConfigError(f"sparsity_kind must be one of {SPARSITY_KINDS}, got {self.sparsity_kind!r}")
        if self.sparsity_kind == "flops" and self.separate_targets:
            raise WideConfigError("sparsity_kind='flops' needs the shared target (sparsity), not attn/ffn_sparsity")
        if self.distill not in DISTILL:
            raise WideConfigError(f"distill must be one of {DISTILL}, got {self.distill!r}")

    @property
    def separate_targets(self) -> bool:
        return self.attn_sparsity is not None

    def routing_shape(self, dims: ModelDims) -> RoutingShape:
        """Resolve group sizes against a model; raise with the valid choices when they do not fit."""
        hq, gqa = dims.n_q_heads, dims.gqa_group
        if self.module_skipping or self.method == "layer-skip":  # one decision per token per block
            return RoutingShape(
                attn_heads_per_group=hq,
                attn_groups=1,
                ffn_group_size=dims.intermediate,
                ffn_groups=1,
                gqa_aligned=False,
            )
        heads = self.attn_group_size or gqa
        if hq % heads:
            valid = [h for h in range(1, hq + 1) if hq % h == 0]
            raise WideConfigError(
                f"attn_group_size={heads} query heads does not divide Hq={hq}; valid choices: {valid} "
                f"(GQA-aligned: {gqa}, one KV group)"
            )
        aligned = heads % gqa == 0 or gqa % heads == 0
        if heads != gqa:
            warnings.warn(
                f"attn_group_size={heads} heads differs from the GQA group ({gqa} heads): the routed "
                "attention kernels need one decision per KV group, so this config only runs the masked "
                "(training/eval) path" + ("" if aligned else " and is not GQA-aligned"),
                stacklevel=2,
            )
        g = self.ffn_group_size
        if dims.intermediate % g:
            valid = [2**k for k in range(4, 12) if dims.intermediate % 2**k == 0]
            raise WideConfigError(
                f"ffn_group_size={g} does not divide the intermediate size {dims.intermediate}; valid choices: {valid}"
            )
        return RoutingShape(
            attn_heads_per_group=heads,
            attn_groups=hq // heads,
            ffn_group_size=g,
            ffn_groups=dims.intermediate // g,
            gqa_aligned=heads == gqa,
        )

    def tau_at(self, step: int, total_steps: int) -> float:
        """Gumbel temperature, annealed linearly from tau_start to tau_end over the run."""
        if total_steps <= 1:
            return self.tau_end
        t = min(max(step / (total_steps - 1), 0.0), 1.0)
        return self.tau_start + (self.tau_end - self.tau_start) * t

    # ------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WideConfig:
        d = dict(d)
        # lookahead routers (each layer deciding from the layer before's input) were removed: their quality
        # cost outweighed the overlap they were for (docs/negative-results.md); configs saved while the
        # field existed carry it, false unless such routers were calibrated
        if d.pop("router_lookahead", False):
            raise WideConfigError("router_lookahead routers are no longer supported (docs/negative-results.md)")
        # the router-imitation training term was removed (docs/negative-results.md); it shaped training only,
        # so routers calibrated with it load and run as any others
        d.pop("router_oracle", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise WideConfigError(f"unknown WideConfig fields: {unknown}")
        return cls(**d)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load_json(cls, path: str | Path) -> WideConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
