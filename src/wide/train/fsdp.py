"""Sharded training of the routers (and LoRA) on a frozen backbone: FSDP2, activation checkpointing,
CPU offload, and trainable-only state that is independent of the number of ranks.

Layout under `--parallel fsdp` (docs/training.md):
  - every decoder layer is its own FSDP2 group (`fully_shard`), the decoder trunk (`model.model`:
    embeddings, final norm) the root group; parameters are sharded over all ranks and gathered one
    layer at a time; `MixedPrecisionPolicy(param_dtype=bf16 on GPU, reduce_dtype=fp32)`;
  - the LM head stays a plain, replicated, frozen tensor: the chunked LM and distillation losses
    (wide.train.losses) read its weight outside any module call, where FSDP's hooks would not gather it;
  - the routers (`WideModel.routers`, beside the HF model, called from hooks) stay plain fp32 replicas
    on every rank; their gradients are averaged in fp32 by `wide.train.distributed.all_reduce_mean_`
    (they are a small fraction of the parameters, and sharding them would need FSDP to gather them
    inside another module's hook);
  - LoRA parameters live inside the decoder layers, so they are sharded with their layer; FSDP
    reduce-scatters their gradients (mean over ranks, fp32).
Activation checkpointing recomputes each decoder layer (torch.utils.checkpoint, non-reentrant, RNG
state preserved, so the recomputed Gumbel noise and masks equal the forward's; no wrapper module, so
parameter names do not change).

Checkpoints hold the trainable state only, gathered to full tensors (small); the frozen backbone is
never gathered or saved. A checkpoint written on N ranks resumes on M ranks, in either mode.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

PARALLEL_MODES = ("replica", "fsdp")
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # torch's wrappers (compile: replica mode)


@dataclass
class ParallelConfig:
    """How the backbone is laid out over the ranks (see the module docstring)."""

    mode: str = "replica"  # replica: a full copy per rank | fsdp: FSDP2 shards per decoder layer
    activation_checkpointing: bool = False  # recompute each decoder layer in the backward pass
    cpu_offload: bool = False  # fsdp only: sharded parameters (and LoRA optimizer state) live on the CPU

    def __post_init__(self) -> None:
        if self.mode not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {PARALLEL_MODES}, got {self.mode!r}")
        if self.cpu_offload and self.mode != "fsdp":
            raise ValueError("--cpu-offload needs --parallel fsdp")


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(t: torch.Tensor) -> bool:
    """True for a DTensor (an FSDP-managed parameter or gradient)."""
    return dist.is_available() and isinstance(t, _dtensor_cls())


def clean_name(name: str) -> str:
    """A parameter name without the wrapper prefixes that activation checkpointing / compile insert."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _layers(wm) -> nn.ModuleList:
    return wm.model.model.layers


def _checkpointed(forward):
    """forward run under a non-reentrant torch.utils.checkpoint whenever autograd records."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run._wide_checkpointed = True
    return run


def apply_activation_checkpointing(wm) -> None:
    """Recompute every decoder layer in the backward pass (idempotent): the layer's forward is replaced
    on the instance by a non-reentrant checkpoint of itself (RNG state preserved), so module names,
    and with them peft's adapter keys and the optimizer state's names, stay those of the plain model;
    FSDP's hooks run outside the checkpointed region. The routers' hooks sit on modules inside the
    layer: they run again in the recomputation and draw the same Gumbel noise."""
    for layer in _layers(wm):
        if not getattr(layer.forward, "_wide_checkpointed", False):
            layer.forward = _checkpointed(layer.forward)


def shard_model(wm, device: torch.device, *, cpu_offload: bool = False) -> None:
    """FSDP2: one group per decoder layer plus the decoder trunk as root; the LM head, the routers and
    τ are moved to `device` and stay replicated. Needs an initialised process group (idempotent)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "--parallel fsdp needs a process group: launch with torchrun, or call "
            "wide.train.distributed.init_from_env(single_process=True) first"
        )
    trunk = wm.model.model
    if isinstance(trunk, FSDPModule):
        return
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # bf16 gathers and compute on GPU (the backbone is bf16 already; LoRA keeps fp32 masters), fp32
    # gradient reduction; on CPU everything stays fp32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else None, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in _layers(wm):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(trunk, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # what FSDP does not manage: the LM head (plain, frozen), routers, τ, the sparsity meter
    for mod in wm.model.children():
        if mod is not trunk:
            mod.to(device)
    wm.routers.to(device)
    wm.register_buffer("_tau", wm._tau.to(device), persistent=False)
    wm.meter_to(device)  # same meter class (a baseline's own accounting), on device


def prepare_model(wm, pc: ParallelConfig, device: torch.device) -> None:
    """Apply activation checkpointing and (mode fsdp) FSDP2 sharding to wm in place. Call after the
    base is frozen and LoRA injected, and before the optimizer is built: sharding replaces the LoRA
    parameters by sharded ones."""
    if pc.activation_checkpointing:
        apply_activation_checkpointing(wm)
    if pc.mode == "fsdp":
        shard_model(wm, device, cpu_offload=pc.cpu_offload)


# ------------------------------------------------------------------------- gradients
@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a mix of replicated tensors (the routers: gradients already
    averaged, identical on every rank) and FSDP-sharded DTensors (each rank holds a disjoint shard).
    Returns the total 2-norm, the same on every rank."""
    params = list(params)
    sharded = [p for p in params if is_sharded(p)]  # decided from the parameters: the same on every rank
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    plain = torch.zeros((), dtype=torch.float32, device=device)
    shard = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if is_sharded(g):
            shard += g.to_local().float().pow(2).sum().to(device)
        else:
            plain += g.float().pow(2).sum().to(device)
    dist.all_reduce(shard, group=sharded[0].device_mesh.get_group())  # disjoint shards: squares add up
    total = (plain + shard).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        local = g.to_local() if is_sharded(g) else g
        local.mul_(coef.to(local.device, local.dtype))
    return total


# ------------------------------------------------------------------- trainable state
def lora_state_dict(adapter) -> dict[str, torch.Tensor] | None:
    """The LoRA parameters of a peft model as full CPU tensors, keyed as `adapter.state_dict()` keys
    them (pass to `adapter.save_pretrained(state_dict=...)`); None without an adapter. Collective when
    the model is sharded (every rank must call it); nothing else of the model is gathered."""
    if adapter is None:
        return None
    out = {}
    for name, p in adapter.named_parameters():
        if "lora_" in name:
            full = p.full_tensor() if is_sharded(p) else p
            out[clean_name(name)] = full.detach().cpu().clone()
    return out


def load_lora_state_(adapter, state: dict[str, torch.Tensor]) -> None:
    """Load a saved peft adapter state (keys as in adapter_model.safetensors) into the LoRA parameters,
    plain or sharded (each rank keeps its shard of the full tensors), behind any wrapper.

    Each parameter's saved key is found with peft's own save-time naming (get_peft_model_state_dict
    applied to index-tagged stand-ins), so wrapper prefixes never reach peft's loader."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor.experimental import implicit_replication

    params = [(clean_name(n), p) for n, p in adapter.named_parameters() if "lora_" in n]
    tagged = get_peft_model_state_dict(adapter, state_dict={n: torch.tensor(i) for i, (n, _) in enumerate(params)})
    key_of = {int(v): k for k, v in tagged.items()}
    missing = [key_of.get(i, n) for i, (n, _) in enumerate(params) if key_of.get(i) not in state]
    if missing:
        raise ValueError(f"adapter checkpoint lacks {len(missing)} LoRA tensors, e.g. {missing[:3]}")
    with torch.no_grad(), implicit_replication():  # a plain full tensor copied into a DTensor: replicated
        for i, (_, p) in enumerate(params):
            full = state[key_of[i]]
            if tuple(full.shape) != tuple(p.shape):
                raise ValueError(f"adapter tensor {key_of[i]}: saved {tuple(full.shape)}, model {tuple(p.shape)}")
            p.copy_(full.to(p.dtype))


def _fqns(module: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Names (relative to module, wrapper prefixes removed) of the optimizer's parameters, in the
    order torch numbers them in `opt.state_dict()`."""
    names = {id(p): clean_name(n) for n, p in module.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def _any_sharded(opt: torch.optim.Optimizer) -> bool:
    return any(is_sharded(p) for g in opt.param_groups for p in g["params"])


def optimizer_state_dict(module: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """`opt.state_dict()` with full (unsharded) CPU tensors, in torch's own numbered layout, so that it
    loads on any number of ranks in either mode. Sharded: collective (every rank calls it), the result
    is on rank 0 only (other ranks get {}). module: the module that owns every optimized parameter
    (the WideModel)."""
    if not _any_sharded(opt):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index = {name: i for i, name in enumerate(_fqns(module, opt))}
    return {
        "state": {index[name]: s for name, s in full["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]],
    }


def load_optimizer_state_dict_(module: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a state written by `optimizer_state_dict` (or a plain `opt.state_dict()`) on any number of
    ranks: sharded parameters take their shard of the full tensors."""
    if not _any_sharded(opt):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _fqns(module, opt)
    by_name = {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(module, opt, by_name, options=StateDictOptions(full_state_dict=True))


# ----------------------------------------------------------------- throughput, memory
def perf_fields(tokens: int, elapsed_s: float, device: torch.device) -> dict:
    """Log fields: tokens/s per GPU (global tokens / ranks / wall time) and, on CUDA, the peak memory
    allocated on each rank since the last reset (GB; a collective under torch.distributed)."""
    from wide.train.distributed import all_gather_floats, world

    _, ws = world()
    rec: dict = {"world_size": ws, "tokens_per_s_per_gpu": tokens / ws / max(elapsed_s, 1e-9)}
    if device.type == "cuda":
        peaks = all_gather_floats(torch.cuda.max_memory_allocated(device) / 1e9, device)
        rec["peak_mem_gb"] = max(peaks)
        rec["peak_mem_gb_per_rank"] = peaks
    return rec
