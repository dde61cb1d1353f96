"""The kernels the recipes lean on, checked on the device that will run them (a part of scripts/gpu_check.sh).

    python -m scripts.gpu_check.kernels --out OUT.json --data DIR          # CUDA: the speedrun's kernels
    python -m scripts.gpu_check.kernels --out OUT.json --data DIR --cpu    # tiny sizes, as far as a CPU goes

flex  FlexAttention with the speedrun's mask (causal, its window, the document mask), compiled as the compiled
      model runs it, against SDPA given the same mask as a dense boolean tensor (model/masks.py's attention_mask),
      in bf16: the output and the q, k and v gradients. An error is the largest deviation from a float64
      reference over the reference's largest magnitude; flex passes where its error is at most twice SDPA's
      own bf16 error plus one bf16 step (2^-8). Also: the seconds to compile flex's forward and backward (head
      size 128, a document mask) and its milliseconds per forward + backward against SDPA's.
      On CPU FlexAttention has no backward: flex is checked forward only, eager, and the gradient comparison
      runs with SDPA in its place (the code path, not the kernel).
ring  200 batches through TokenLoader's pinned CUDA staging buffers equal the CPU path's, byte for byte, at the
      speedrun's and the hackathon's shapes, in their configs' order; the speedrun's second half in its last
      stage's longer rows (train.batch_stage_rows), in buffers made anew. The device batches are all kept,
      unsynced, while a queue of matmuls holds their copies back: a staging buffer refilled before its copy ran
      would show. On CPU: the batches of one CPU loader, all held as they came, against another's.
fp8   model/fp8.py's fp8_matmul (model.fp8_head) at the speedrun's head on one GPU: a micro-step's tokens of
      configs/speedrun_1gpu.toml (16,384 rows of 768, RMS 1 each, as the final norm gives), a head of N(0, 0.02)
      weights over the padded vocabulary (50,304), the gradient of a mean cross-entropy, at head_scales' scales:
      the output and x's and w's gradients against a float64 reference, eager and compiled with fullgraph=True.
      An error is rel_error's; each passes where it is at most what fp8_matmul_bounds allows (the float8 casts'
      rounding and the bf16 output's), as a share of the reference's largest magnitude. Also: the seconds to
      compile it and the milliseconds per forward + backward, eager and compiled, against the bf16 head's
      (F.linear under bf16 autocast, as the model runs it without the key). CUDA's _scaled_mm wants its first
      operand row-major, its second column-major and sizes that are multiples of 16; the CPU's does not check:
      on CPU, 128 rows of 64 and a vocabulary of 256, the same code.
symmetric  optim/symmetric.py's Triton kernel (optim.muon_symmetric) at the shapes Muon's Newton-Schulz meets in a
      step of configs/speedrun_1gpu.toml and gives the kernel (its matrices and views, wide, stacked by shape; the
      gates' are one tile, the plain matmuls'), in bf16, on X with singular values spread in (0, 1]: X X^T = A,
      A A^T, Polar Express's first b A + c A^2 and its whole five steps against float64, each passing where its
      error is at most twice the plain bf16 matmuls' (X @ X^T, A @ A^T, baddbmm, the iteration without the
      kernel) plus one bf16 step; and the milliseconds of the five-step Polar Express of those stacks, with the
      kernel and without, eager (as Muon runs it by default). On CPU, in Triton's interpreter (TRITON_INTERPRET=1,
      set by --cpu), fp32, two small stacks.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from data.loader import TokenLoader
from model.fp8 import fp8_matmul, fp8_matmul_bounds, head_scales
from model.gpt import GPT
from model.masks import attention_mask, flex_attention, flex_block_mask, flex_mask_mod
from optim.views import blocks
from trainer import ROOT
from util.atomic import write_json
from trainer.config import Config, parse_args as parse_train_args

RING_BATCHES = 200
FLEX_MAX_T = 4096
FP8_CPU_SHAPE = (128, 64, 256)  # rows, width, vocabulary: multiples of 16, as CUDA's _scaled_mm needs
SYMMETRIC_CPU_STACKS = {(128, 160): 2, (192, 200): 1}  # (rows, columns): matrices; two and three tiles a side
SYMMETRIC_ERRORS = ("gram", "square", "poly", "iteration")  # symmetric_check's, each against its plain twin's
BF16_STEP = 2.0 ** -8  # bf16's spacing just above 1: its 8-bit significand


def documents(batch: int, seq_len: int, bos_id: int, docs: int, gen: torch.Generator) -> torch.Tensor:
    """Token rows opening with bos_id, with docs - 1 more at random places: several documents a row."""
    idx = torch.randint(0, bos_id, (batch, seq_len), generator=gen)
    idx[:, 0] = bos_id
    for row in idx:
        row[torch.randperm(seq_len - 1, generator=gen)[:docs - 1] + 1] = bos_id
    return idx


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def tolerance(sdpa_error: float) -> float:
    """The most a bf16 kernel may deviate where SDPA in bf16 deviates sdpa_error: twice that, plus one bf16 step."""
    return 2 * sdpa_error + BF16_STEP


def attention_errors(attend: Callable, q, k, v, dy, ref: dict, grads: bool) -> dict:
    """Errors of attend(q, k, v)'s output (and q, k, v gradients) against the reference's."""
    q, k, v = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    y = attend(q, k, v)
    out = {"out": rel_error(y, ref["out"])}
    if grads:
        y.backward(dy)
        out.update({f"d{name}": rel_error(t.grad, ref[f"d{name}"]) for name, t in zip("qkv", (q, k, v))})
    return out


def reference(q, k, v, dy, mask) -> dict:
    """SDPA in float64 (the math kernel) with the dense mask: the output and the q, k, v gradients."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    y.backward(dy.double())
    return {"out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def seconds_per_call(fn: Callable, cuda: bool, repeat: int = 5) -> float:
    """Median wall seconds of fn() (synchronised on CUDA)."""
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flex_check(cfg, device: torch.device, cpu: bool) -> dict:
    """FlexAttention against SDPA at the speedrun's head size, window and document mask (module docstring)."""
    model_cfg = cfg.model
    if flex_attention is None:
        return {"status": "n/a: this torch build has no FlexAttention"}
    # at most 4,096 tokens: the float64 reference holds [B, H, T, T] scores (1.6 GB at 4,096), and the records'
    # 49,152-token sequences would need 230 GB
    B, T = (1, 256) if cpu else (2, min(cfg.train.seq_len, FLEX_MAX_T))
    # None for no window: model/masks.py reads both a window of 0 and None as "none"
    window = (min(model_cfg.window, T // 4) if cpu else model_cfg.window) or None
    H, D = (2 if cpu else model_cfg.n_head), model_cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    idx = documents(B, T, model_cfg.bos_id, max(2, T // 600), gen).to(device)  # FineWeb: ~1,000 tokens a document
    q, k, v, dy = (torch.randn(B, H, T, D, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    mask = attention_mask(idx, window, model_cfg.doc_causal, model_cfg.bos_id)
    ref = reference(q, k, v, dy, mask)
    res = {"shape": {"batch": B, "heads": H, "seq_len": T, "head_dim": D, "window": window,
                     "doc_causal": model_cfg.doc_causal, "documents": int((idx == model_cfg.bos_id).sum())}}
    t0 = time.perf_counter()
    block_mask = _block_mask(idx, window, model_cfg, device, cpu)
    res["block_mask_s"] = time.perf_counter() - t0

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    res["sdpa"] = attention_errors(sdpa, q, k, v, dy, ref, grads=True)
    if cpu:  # no flex backward on CPU: the forward, eager; gradients through the same code with SDPA in its place
        res["flex"] = attention_errors(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask),
                                       q, k, v, dy, ref, grads=False)
        res["flex"].update({g: res["sdpa"][g] for g in ("dq", "dk", "dv")})
        res["grads_by"] = "sdpa: FlexAttention has no backward on CPU"
    else:
        res.update(_compiled_flex(block_mask, sdpa, q, k, v, dy, ref))
    res["tolerance"] = {name: tolerance(err) for name, err in res["sdpa"].items()}
    res["ok"] = {name: res["flex"][name] <= res["tolerance"][name] for name in res["sdpa"]}
    return res


def _block_mask(idx: torch.Tensor, window: int | None, model_cfg, device: torch.device, cpu: bool):
    """FlexAttention's block mask for the [B, T] tokens `idx`, as the model builds it (densely on CPU)."""
    if not cpu:
        return flex_block_mask(idx, window, model_cfg.doc_causal, model_cfg.bos_id)
    # the model's rule (its mask_mod), evaluated densely: flex_block_mask compiled its builder, which took
    # 15-60 s on this project's 2 CPU cores
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = idx.shape
    mask_mod = flex_mask_mod(idx, window, model_cfg.doc_causal, model_cfg.bos_id)
    return create_block_mask(mask_mod, B, None, T, T, device=device)


def _compiled_flex(block_mask, sdpa: Callable, q, k, v, dy, ref: dict) -> dict:
    """CUDA: compiled FlexAttention's errors and compile seconds, and both kernels' ms per forward + backward."""
    flex = torch.compile(flex_attention)  # as inside the compiled model: eager flex is a slow reference

    def attend(q, k, v):
        return flex(q, k, v, block_mask=block_mask)

    t0 = time.perf_counter()
    res = {"flex": attention_errors(attend, q, k, v, dy, ref, grads=True)}
    torch.cuda.synchronize()
    res["compile_s"] = time.perf_counter() - t0
    res["grads_by"] = "flex"

    def forward_backward(attend: Callable) -> None:
        leaves = (t.detach().requires_grad_() for t in (q, k, v))
        attend(*leaves).backward(dy)

    res["ms"] = {name: 1000 * seconds_per_call(lambda fn=fn: forward_backward(fn), cuda=True)
                 for name, fn in (("flex", attend), ("sdpa", sdpa))}
    return res


def fp8_operands(rows: int, width: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The head's input x [rows, width] (RMS 1 a row, as the final norm gives, in bf16 as under train.bf16_stream),
    its fp32 weights w [vocab, width] at N(0, 0.02), and the gradient a mean cross-entropy of random logits gives
    its output, (softmax - one-hot) / rows in bf16: at most 1 / rows, as head_scales expects."""
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(rows, width, device=device, generator=gen)
    x = (x / x.square().mean(-1, keepdim=True).sqrt()).bfloat16()
    w = 0.02 * torch.randn(vocab, width, device=device, generator=gen)
    grad = torch.softmax(3 * torch.randn(rows, vocab, device=device, generator=gen), -1)
    targets = torch.randint(0, vocab, (rows,), device=device, generator=gen)
    grad[torch.arange(rows, device=device), targets] -= 1  # not F.one_hot: int64, 6.6 GB at the speedrun's head
    return x, w, grad.div_(rows).bfloat16()


def fp8_check(cfg, device: torch.device, cpu: bool) -> dict:
    """fp8_matmul against float64 at the speedrun's head shape, eager and compiled, and its speed against the bf16
    head's (module docstring); `cfg` is configs/speedrun_1gpu.toml's."""
    N, K, V = FP8_CPU_SHAPE if cpu else (cfg.train.batch_size * cfg.train.seq_len, cfg.model.n_embd,
                                         cfg.model.padded_vocab)
    x, w, grad = fp8_operands(N, K, V, device)
    s = head_scales(K, N)

    def fp8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fp8_matmul(x, w, s)

    def bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16):  # the head without the key
            return F.linear(x, w)

    bounds = fp8_matmul_bounds(x, w, grad, s)
    res = {"shape": {"rows": N, "width": K, "vocab": V}, "scales": s._asdict(),
           "bound": {name: (bound.max() / want.abs().max()).item() for name, (want, bound) in bounds.items()},
           "eager": fp8_errors(fp8, x, w, grad, bounds)}
    compiled = torch.compile(fp8, fullgraph=True)
    t0 = time.perf_counter()
    res["compiled"] = guarded(fp8_errors, compiled, x, w, grad, bounds)  # a compile error keeps the rest
    res["compile_s"] = time.perf_counter() - t0
    del bounds  # 13 GB at the speedrun's shape
    res["ok"] = {run: "error" not in res[run] and all(res[run][name] <= res["bound"][name] for name in res["bound"])
                 for run in ("eager", "compiled")}

    def forward_backward(matmul: Callable) -> None:
        matmul(x.detach().requires_grad_(), w.detach().requires_grad_()).backward(grad)

    runs = {"fp8": fp8, "bf16": bf16, **({} if "error" in res["compiled"] else {"fp8_compiled": compiled})}
    # a few ms each at the speedrun's shape, 20 calls to steady the median; ~0.2 s on CPU even at its sizes
    res["ms"] = {name: 1000 * seconds_per_call(lambda fn=fn: forward_backward(fn), not cpu, repeat=3 if cpu else 20)
                 for name, fn in runs.items()}
    res["speedup"] = res["ms"]["bf16"] / res["ms"].get("fp8_compiled", res["ms"]["fp8"])
    return res


def fp8_errors(matmul: Callable, x, w, grad, bounds: dict) -> dict:
    """rel_error of matmul(x, w)'s output and of x's and w's gradients for `grad` against the float64 values in
    `bounds` (fp8_matmul_bounds')."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = matmul(x, w)
    out.backward(grad)
    results = {"out": out, "grad_x": x.grad, "grad_w": w.grad}
    return {name: rel_error(got, bounds[name][0]) for name, got in results.items()}


def muon_stacks(cfg: Config) -> Counter[tuple[int, int]]:
    """{(rows, columns): count}: the wide matrices Muon orthogonalises in a step of `cfg`'s model, by shape (views
    of a fused parameter apart), as its batched Newton-Schulz calls meet them; the model is built on the meta
    device, with no memory."""
    from optim.groups import build_optimizers  # imports optim/symmetric.py: after main() chose the interpreter

    with torch.device("meta"):
        model = GPT(cfg.model)
    optim = dataclasses.replace(cfg.optim, muon_symmetric=False, bf16_storage=False)  # no kernel, no hooks: shapes
    stacks = Counter()
    for group in build_optimizers(model, optim)[1].param_groups:
        for p in group["params"]:
            for b in blocks(p.shape, group["split"]):
                stacks[tuple(sorted((b.rows, p.shape[1])))] += b.count
    return stacks


def symmetric_check(cfg: Config, device: torch.device, cpu: bool) -> dict:
    """The symmetric-product kernel against float64 and the plain matmuls, and Polar Express's time with it and
    without, at the stacks where Newton-Schulz calls it (module docstring); `cfg` is configs/speedrun_1gpu.toml's."""
    from optim.muon import newton_schulz
    from optim.symmetric import saves, unavailable

    if reason := unavailable(device):
        return {"status": f"n/a: {reason}"}
    dtype = torch.float32 if cpu else torch.bfloat16
    stacks = SYMMETRIC_CPU_STACKS if cpu else muon_stacks(cfg)
    gen = torch.Generator(device).manual_seed(0)
    res: dict = {"dtype": str(dtype).removeprefix("torch."), "errors": {}, "ok": {}}
    xs = {}
    for (m, n), count in stacks.items():
        if not saves(m):
            continue  # the plain matmuls' (the gates')
        x = torch.randn(count, m, n, device=device, generator=gen)
        # singular values in (0, 1], spread as a gradient's: A's square then weighs as much as A in b A + c A^2
        x = xs[m, n] = (x / torch.linalg.matrix_norm(x, ord=2)[:, None, None]).to(dtype)
        errors = symmetric_errors(x, torch.ops.shardrun.symmetric_product)
        want = newton_schulz(x.double(), 5, "polar_express", dtype=torch.float64)
        errors.update({f"iteration{suffix}": rel_error(newton_schulz(x, 5, "polar_express", kernel, dtype=dtype), want)
                       for suffix, kernel in (("", True), ("_plain", False))})
        key = f"{count} x {m} x {n}"
        res["errors"][key] = errors
        res["ok"][key] = all(errors[name] <= tolerance(errors[f"{name}_plain"]) for name in SYMMETRIC_ERRORS)

    def iterate(kernel: bool) -> None:
        for x in xs.values():
            newton_schulz(x, 5, "polar_express", kernel, dtype=dtype)
    res["ms"] = {name: 1000 * seconds_per_call(lambda k=kernel: iterate(k), not cpu, repeat=3 if cpu else 20)
                 for name, kernel in (("matmul", False), ("symmetric", True))}
    res["speedup"] = res["ms"]["matmul"] / res["ms"]["symmetric"]
    return res


def symmetric_errors(x: torch.Tensor, product: Callable) -> dict:
    """rel_error against float64 of `product`'s X X^T = A, A A^T and b A + c A^2 (A `product`'s own, b and c Polar
    Express's first), and of the plain matmuls' (X @ X^T, A @ A^T, baddbmm)."""
    from optim.quintics import POLAR_EXPRESS_COEFFS

    _, b, c = POLAR_EXPRESS_COEFFS[0]
    a = product(x, 1.0, None, 0.0)
    gram, a64 = x.double() @ x.double().mT, a.double()
    square, poly = a64 @ a64.mT, b * a64 + c * a64 @ a64
    return {"gram": rel_error(a, gram), "gram_plain": rel_error(x @ x.mT, gram),
            "square": rel_error(product(a, 1.0, None, 0.0), square), "square_plain": rel_error(a @ a.mT, square),
            "poly": rel_error(product(a, c, a, b), poly),
            "poly_plain": rel_error(torch.baddbmm(a, a, a, beta=b, alpha=c), poly)}


def hold_back_copies(device: torch.device) -> None:
    """Queue ~0.5 s of matmuls on the current stream (CUDA): the ring's copies queued after them must wait."""
    if device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(300):  # ~1.1 TFLOP each: ~1.5 ms on an H100
        torch.mm(a, a, out=out)


def ring_check(files: str, batch_size: int, seq_len: int, data, bos_id: int | None, device: torch.device,
               n: int = RING_BATCHES, keep: Callable | None = None, longer: int = 0) -> dict:
    """n batches of a TokenLoader on `device`, all held, against the CPU loader's; `data` is the config's [data]
    section (format, raw dtype, order). `keep(batch)` is what is held of each batch: by default the batch itself,
    which belongs to its caller on every device. `longer` > 0: the second half in rows of that many tokens, as
    train.batch_stage_rows lengthens them, through staging buffers made anew."""
    cuda = device.type == "cuda"
    keep = keep or (lambda b: b)
    kw = dict(bos_id=bos_id, fmt=data.format, raw_dtype=data.raw_dtype, seed=0, shuffle=data.shuffle,
              max_seq_len=longer)
    with TokenLoader(files, batch_size, seq_len, device="cpu", **kw) as want, \
            TokenLoader(files, batch_size, seq_len, device=device, prefetch=4 if cuda else 1, **kw) as got:
        hold_back_copies(device)

        def batches(loader: TokenLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for i in range(n):
                if longer and i == n // 2:
                    loader.set_seq_len(longer)
                yield next(loader)
        held = [keep(batch) for batch in batches(got)]
        bad = [i for i, (batch, wanted) in enumerate(zip(held, batches(want)))
               if not all(torch.equal(a.cpu(), b) for a, b in zip(batch, wanted))]
        same_state = got.state_dict() == want.state_dict()
    return {"batches": n, "shape": [batch_size, seq_len], "longer": longer, "bos_aligned": bos_id is not None,
            "mismatches": len(bad), "first_mismatch": bad[0] if bad else None, "state_equal": same_state,
            "compared": "pinned CUDA staging vs CPU" if cuda else "CPU (prefetch 1) vs CPU (prefetch 4), held"}


def main(argv: list[str] | None = None) -> None:
    """Run the checks and write their results to --out (rewritten after each)."""
    p = argparse.ArgumentParser(prog="python -m scripts.gpu_check.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="gpu_check's data folder (random/ and raw/)")
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU")
    args = p.parse_args(argv)
    if args.cpu:  # before optim/symmetric.py's kernel is defined: Triton reads it then
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check.kernels: no CUDA device; use --cpu")
    device = torch.device("cpu" if args.cpu else "cuda")
    speedrun, hackathon = (parse_train_args(["--config", str(ROOT / "configs" / f"{name}.toml")])
                           for name in ("speedrun_8xh100", "hackathon_32gpu"))
    res: dict = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0)}
    small = (2, 128) if args.cpu else None
    for name, cfg, files in (("ring_speedrun", speedrun, args.data / "random" / "random_train_*.bin"),
                             ("ring_hackathon", hackathon, args.data / "raw" / "chunk_*.bin")):
        B, T = small or (cfg.train.batch_size, cfg.train.seq_len)
        bos_id = cfg.model.bos_id if cfg.data.bos_aligned else None
        longer = T * max(cfg.train.batch_stages) if cfg.train.batch_stage_rows else 0
        res[name] = guarded(ring_check, str(files), B, T, cfg.data, bos_id, device, RING_BATCHES, None, longer)
        write_json(args.out, res)
    res["flex"] = guarded(flex_check, speedrun, device, args.cpu)
    write_json(args.out, res)
    one_gpu = parse_train_args(["--config", str(ROOT / "configs" / "speedrun_1gpu.toml")])
    res["fp8"] = guarded(fp8_check, one_gpu, device, args.cpu)
    write_json(args.out, res)
    res["symmetric"] = guarded(symmetric_check, one_gpu, device, args.cpu)
    write_json(args.out, res)


def guarded(check: Callable, *args) -> dict:
    """check(*args), or {"error": what it raised}: one broken kernel must not hide the other results (nor a
    compile error the eager run's)."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - reported as the check's verdict
        return {"error": f"{type(e).__name__}: {e}"[:2000]}

if __name__ == "__main__":
    main()
