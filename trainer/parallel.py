"""Parallelism, compile and precision, applied from outside a plain nn.Module.

`parallelize` returns a ParallelModel: the model to call and the plain module it wraps, from which state
dicts come, so saved keys never carry `module.` (DDP) or `_orig_mod.` (compile) prefixes: nn.Module.compile()
compiles in place, unlike torch.compile(module), which wraps. What differs between one process, DDP and FSDP2
(which module evaluates, how the full state is gathered, the gradient sync, the gradient norm) is answered
here, so the training loop never asks which one it runs under.
"""
from __future__ import annotations

import contextlib
import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from optim.bf16_storage import stored_in_bf16
from optim.symmetric import unavailable
from trainer.config import Config, ConfigError, TrainConfig
from trainer.distributed import Dist

# The buffers are alike on every rank: GPT.windows is set from the agreed schedule, the bigram sign patterns are
# drawn from a fixed seed. Broadcasting them from rank 0 before every forward, DDP's default, would be a collective
# for nothing. torch 2.13 renamed the switch (broadcast_buffers warns there); the new one still broadcasts buffers
# once at construction, which is harmless.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})
# sync_apart sends gradients smaller than this in one buffer: a collective each would cost more in launches than
# in bytes (the scalars)
COALESCE = 1 << 16


@dataclass
class ParallelModel:
    """A model as parallelize left it: called like the module; the rest answers for its parallelism."""
    module: nn.Module            # the plain GPT: state dicts come from here, never from the wrapper
    wrapped: nn.Module           # what training calls: DDP / FSDP2 / compiled (the module itself but under DDP)
    sharded: bool                # FSDP2 over several ranks: each holds a shard of the model and optimizer state
    master: bool                 # rank 0, which gets the full state
    apart: Sequence[nn.Parameter] = ()  # what DDP leaves alone: sync_apart averages their gradients (train.adam_sync)
    bf16_wire: frozenset[int] = frozenset()  # the ids of the parameters whose gradients cross in bf16 (reduce_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapped(*args, **kwargs)

    @property
    def kind(self) -> str:
        """What wraps the module: "ddp", "fsdp" or "no wrapper" (the run's header line says it)."""
        if self.sharded:
            return "fsdp"
        return "ddp" if isinstance(self.wrapped, DDP) else "no wrapper"

    @property
    def eval_module(self) -> nn.Module:
        """What evaluates: under FSDP2 the wrapped model (its all-gathers need every rank's same forward calls),
        else the plain module, which needs no collective (DDP's wrapper would sync buffers)."""
        return self.wrapped if self.sharded else self.module

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The plain module's full state dict as CPU tensors on rank 0, None on the others; every rank calls it
        (FSDP2 gathers the shards; replicas copy nothing: rank 0's is every rank's)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=True))
            return state if self.master else None
        if not self.master:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def sync_apart(self) -> Callable[[], None]:
        """Start averaging over the ranks the gradients of the parameters DDP leaves alone (`apart`), each in its
        wire's dtype (bf16 for those in `bf16_wire`), as DDP does its buckets'; returns the call that waits for the
        sums and leaves them in the gradients. Until then nothing may read or write those gradients."""
        grads = [(p.grad, torch.bfloat16 if id(p) in self.bf16_wire else torch.float32)
                 for p in self.apart if p.grad is not None]
        messages = [([g], dtype) for g, dtype in grads if g.numel() >= COALESCE]
        for wire in (torch.float32, torch.bfloat16):
            small = [g for g, dtype in grads if dtype == wire and g.numel() < COALESCE]
            messages += [(small, wire)] if small else []
        pending = []
        for tensors, dtype in messages:
            sent = _packed(tensors, dtype)
            pending.append((tensors, sent, torch_dist.all_reduce(sent, async_op=True)))

        def finish() -> None:
            for tensors, sent, work in pending:
                work.wait()
                _unpack(tensors, sent)
        return finish

    def grad_sync(self, sync: bool) -> ContextManager:
        """A context for one micro-step's backward that skips the gradient all-reduce unless `sync`."""
        if isinstance(self.wrapped, DDP):
            return contextlib.nullcontext() if sync else self.wrapped.no_sync()
        if hasattr(self.wrapped, "set_requires_gradient_sync"):  # FSDP2
            self.wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grads(self, max_norm: float, wanted: bool = True) -> torch.Tensor | None:
        """The global L2 norm of the gradients (before clipping); with max_norm > 0 they are scaled to at most
        that. None without a clip where the norm is not `wanted` (a step that logs none): no pass over the
        gradients that nobody reads.

        Under FSDP2 each rank holds DTensor shards of the gradients, and their norm is a DTensor (a partial
        result on some torch versions, already reduced on others): full_tensor() makes it the whole gradient's
        norm, the same on every rank (as torchtitan's clip_grad_norm_ does). DDP's gradients are equal on every
        rank already. A device tensor: nothing here waits for the GPU. (get_total_norm and
        clip_grads_with_norm_: torch >= 2.6.)
        """
        if max_norm <= 0 and not wanted:
            return None
        params = [p for p in self.wrapped.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def compiler_missing() -> str | None:
    """Why inductor cannot build CPU kernels on this machine, or None: it compiles them with a C++ compiler, against
    Python's C headers (a system Python may come without them)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except (InvalidCxxCompiler, OSError):  # OSError: CXX names a folder or a file that cannot run
        cxx = inductor_config.cpp.cxx
        tried = cxx if isinstance(cxx, str) else ", ".join(name for name in cxx if name)
        return (f"inductor builds its kernels with a C++ compiler and found none (it tried {tried}); install g++ "
                f"or clang++ (CXX names another)")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.is_file():
        return (f"inductor builds its kernels against Python's C headers, which this Python lacks ({header}); "
                f"install its development package (python3-dev on Debian and Ubuntu)")
    return None


def cannot_compile() -> str | None:
    """compiler_missing(), or else the first line of what a trial compile raises (a toolchain that cannot build
    inductor's kernels, macOS's clang without OpenMP): run.sh's test before it compiles the CPU track."""
    reason = compiler_missing()
    if reason is None:
        try:
            torch.compile(lambda x: torch.sin(x) + 1, dynamic=False)(torch.ones(8))
        except Exception as e:  # noqa: BLE001 - whatever inductor raises means the same: train eagerly
            e = getattr(e, "inner_exception", e)  # dynamo's BackendCompilerFailed, on older torch, wraps it
            reason = f"inductor's trial compile failed: {(str(e).strip().splitlines() or [type(e).__name__])[0]}"
    return reason


def check_kernels(cfg: Config, device: torch.device) -> None:
    """Refuse the keys whose kernels cannot be built here, else the first step would fail inside them with their
    traceback: train.compile or optim.muon_compile on a CPU where inductor cannot build its kernels,
    optim.muon_symmetric where Triton cannot run its kernel."""
    keys = cfg.compiled_keys
    reason = compiler_missing() if keys and device.type == "cpu" else None
    if reason:
        raise ConfigError(f"{keys[0]} on CPU: {reason}, or set " + " ".join(f"--{key}=false" for key in keys))
    reason = unavailable(device) if cfg.optim.muon_symmetric else None
    if reason:
        raise ConfigError(f"optim.muon_symmetric = true: optim/symmetric.py's Triton kernel cannot run here: "
                          f"{reason}; or set --optim.muon_symmetric=false")


def parallelize(model: nn.Module, cfg: TrainConfig, dist: Dist, backend: str | Callable = "inductor",
                apart: Sequence[nn.Parameter] = ()) -> ParallelModel:
    """Move `model` to dist.device and wrap it for cfg.parallel (DDP or FSDP2) and cfg.compile; `backend` is
    torch.compile's (tests give aot_eager: dynamo's graphs, guards and recompiles alike, without code generation).
    Under cfg.bf16_stream the model keeps its residual stream, head and training loss in autocast's dtype. Under
    cfg.adam_sync = "adam_steps", DDP leaves the parameters in `apart` (AdamW's) alone: ParallelModel.sync_apart
    averages their gradients. Under cfg.reduce_dtype = "storage" the gradients of optim.bf16_storage's bf16-stored
    weights cross the ranks in bf16, the others in fp32."""
    model.to(dist.device)
    model.autocast_stream = cfg.bf16_stream  # before compile: dynamo reads it as a constant of the graph
    if dist.world_size > 1 and cfg.parallel == "fsdp":
        return ParallelModel(model, _fully_shard(model, cfg, dist, backend), sharded=True, master=dist.master)
    if cfg.compile:
        # In place, so that evals (which call the plain module) run compiled too; under DDP dynamo still splits
        # the graph at DDP's bucket boundaries, since it compiles inside DDP's forward. Static shapes (dynamic=False,
        # as the records compile): the eval's shape gets a graph of its own instead of making dynamo recompile the
        # training graph with symbolic shapes, which every later shape would then share.
        model.compile(backend=backend, dynamic=False)
    if cfg.parallel != "ddp" or (dist.world_size == 1 and not cfg.ddp_always):
        return ParallelModel(model, model, sharded=False, master=dist.master)
    # The gradients are views of DDP's buckets rather than a second copy of them; zero_grad's set_to_none drops
    # the views only, and the next backward's gradients are copied into the buckets again. A gradient kept across
    # steps (optim.adam_every) stays a view: the next backward adds to it in its bucket before the all-reduce.
    apart = list(apart) if cfg.adam_sync == "adam_steps" else []
    if apart:
        DDP._set_params_and_buffers_to_ignore_for_model(model, _ddp_names(model, apart))
    wrapped = DDP(model, device_ids=[dist.local_rank] if dist.cuda else None, gradient_as_bucket_view=True,
                  **_NO_BUFFER_SYNC)
    bf16_wire = frozenset(map(id, model.parameters() if cfg.reduce_dtype == "bfloat16"
                              else stored_in_bf16(model) if cfg.reduce_dtype == "storage" else []))
    if bf16_wire:
        # The hook runs on the synced micro-step's backward only: under no_sync the micro-steps add up in the fp32
        # buckets, and the sum crosses the wire in bf16, to come back into them as fp32.
        wrapped.register_comm_hook(bf16_wire, _all_reduce_by_dtype)
    return ParallelModel(model, wrapped, sharded=False, master=dist.master, apart=apart, bf16_wire=bf16_wire)


def _ddp_names(model: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    """Every name under which DDP may meet `params` in `model`: its own dotted names, and its reducer's
    "<module>.<name>" under each module that holds one (a tied parameter under both modules; ".name" for the root's
    own, such as GPT.skip_lambda)."""
    ids = {id(p) for p in params}
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids]
    return names + [f"{m}.{n}" for m, module in model.named_modules(remove_duplicate=False)
                    for n, p in module.named_parameters(recurse=False) if id(p) in ids]


def _fully_shard(model: nn.Module, cfg: TrainConfig, dist: Dist, backend: str | Callable) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    compute = torch.bfloat16 if dist.cuda and cfg.dtype == "bfloat16" else None  # None: the parameters' fp32
    wire = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.reduce_dtype]  # "storage": DDP's only
    if compute or wire != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=wire)
    # One FSDP unit per block, so only one block's full weights are gathered at a time. Each block is compiled
    # before it is sharded, as torchtitan does (models/llama3/parallelize.py: compile, then fully_shard): FSDP2's
    # hooks then run around the compiled block, and its all-gathers stay out of the graph.
    for block in model.blocks:
        if cfg.compile:
            block.compile(backend=backend, dynamic=False)
        fully_shard(block, **kwargs)
    if cfg.compile:
        # The tail (final norm, head, fp32 cast, softcap, cross-entropy) works on [tokens x vocab] fp32 logits:
        # eager, each op is a full pass over them; compiled, they fuse. It runs inside the root unit's forward,
        # after the root's all-gather, like a block.
        model.head_loss = torch.compile(model.head_loss, backend=backend, dynamic=False)
    fully_shard(model, **kwargs)
    return model


def _all_reduce_by_dtype(bf16_wire, bucket):
    """DDP's all-reduce of one bucket, each gradient averaged in its wire's dtype: bf16 for the parameters whose
    ids are in `bf16_wire`, fp32 for the rest. A bucket of one dtype crosses whole (an fp32 one in place, as DDP's
    own all-reduce; a bf16 one as torch's bf16_compress_hook sends it); a mixed one in a message of each dtype, its
    gradients copied out (an fp32 one alone sent in place): DDP's buckets can put a whole embedding table beside a
    few fp32 scalars. Unannotated: DDP compares a hook's annotations with its own types, and this module's are
    strings."""
    buffer, grads = bucket.buffer(), bucket.gradients()
    low = [id(p) in bf16_wire for p in bucket.parameters()]
    if all(low) or not any(low):
        messages = [([buffer], torch.bfloat16 if all(low) else torch.float32)]
    else:
        messages = [([g for g, bf16 in zip(grads, low) if bf16 == wire], dtype)
                    for wire, dtype in ((True, torch.bfloat16), (False, torch.float32))]
    sent = [(tensors, _packed(tensors, dtype)) for tensors, dtype in messages]
    futures = [torch_dist.all_reduce(message, async_op=True).get_future() for _, message in sent]

    def unpack(_) -> torch.Tensor:
        # Chained on the last future, waiting for the others inside, as torch's PowerSGD hook waits inside its
        # callbacks: a CUDA future's callback runs on a stream that waits for its work, and wait() adds the others'.
        # torch.futures.collect_all's future holds no devices: neither a callback on it nor DDP's wait on its
        # result would be ordered after the collectives on CUDA.
        for future in futures[:-1]:
            future.wait()
        for tensors, message in sent:
            _unpack(tensors, message)
        return buffer
    return futures[-1].then(unpack)


def _packed(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`tensors` as one message in `dtype`, divided by the world size so that the ranks' sum is their average: a
    tensor alone in that dtype is sent itself, in place; else a copy."""
    message = (tensors[0] if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])).to(dtype)
    return message.div_(torch_dist.get_world_size())


def _unpack(tensors: list[torch.Tensor], message: torch.Tensor) -> None:
    """Copy what `message` brought back into `tensors` (nothing to do where they were sent in place)."""
    if message is not tensors[0]:
        for t, part in zip(tensors, message.reshape(-1).split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def autocast(dist: Dist, dtype: str) -> ContextManager:
    """bf16 autocast on GPU; CPU runs in fp32 (CPU autocast is slow and changes results)."""
    if dist.cuda and dtype == "bfloat16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
