"""Train a Hugging Face MoE causal LM with ``torch.compile(backend="moe")``: a complete loop to copy.

    python examples/train.py                                   # small Qwen3-MoE, CPU or one GPU, ~1 min on CPU
    python examples/train.py --model-type mixtral --set num_local_experts=16 --layers 8   # small widths
    python examples/train.py --config path/to/config.json      # any transformers config (from_config)
    python examples/train.py --checkpoint path/to/model_dir    # a local checkpoint (from_pretrained)
    python examples/train.py --amp                             # fp32 weights, forward under torch.autocast(bf16)
    torchrun --nproc-per-node 2 examples/train.py              # FSDP2 over 2 ranks (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 4 examples/train.py --ep 2       # expert parallelism 2 x FSDP2 data parallel 2
    python examples/train.py --grad-checkpointing --compile blocks   # activation checkpointing (transformers')

What it does: builds the model (random init, or the checkpoint), compiles it with ``backend="moe"``
(each MoE layer rewritten into grouped GEMMs; ``--compile blocks`` compiles each decoder layer on its
own, ``moe_compile.compile_blocks``), and trains it with AdamW on synthetic data that needs no
download but can be learnt: every sequence follows a fixed random permutation of the vocabulary
(next token = perm[token]) except for ``--noise`` of the tokens, which are uniform, so the loss
falls from ln(vocab) towards the data's entropy (printed as the floor). A progress bar shows the
loss, tokens/s and model TFLOP/s (per rank; FLOPs by NeMo Automodel's formula, examples/flops.py).
Then the same model from the same initial weights trains on the same batches with stock
``torch.compile`` (``--stock``, default on a GPU) and eagerly (unless ``--no-eager``); the loss curves
are written to ``--out`` (``loss.csv``; ``loss.png`` when matplotlib is installed) and the largest and
mean |loss - eager's loss| of each compiled run are printed: in bf16 on a GPU, compiled training
drifts from eager by rounding alone, and backend="moe" should drift no more than stock does.

Precision: bf16 parameters on a GPU, fp32 on the CPU; ``--amp`` keeps fp32 parameters (and AdamW
state) and runs the forward under ``torch.autocast(device, torch.bfloat16)``, as Hugging Face
Trainer's ``bf16=True`` does. Under autocast transformers' ``grouped_mm`` experts compute in fp32 in
eager, and so in the compiled run (``moe_compile.explain`` notes it; docs/benchmarks.md, section 0).

Distributed (under torchrun): every rank trains on its own batches (data parallel), the decoder
layers and the root are ``fully_shard``-ed (FSDP2). ``--ep N`` also shards the experts over N ranks
(``moe_compile.parallelize_experts``) and keeps them out of FSDP (the layers' ``fully_shard`` get
them as ``ignored_params``): with ``--ep`` equal to the number of ranks through
``moe_compile.fully_shard_experts``, on more ranks whole on the ranks holding the same experts
(``moe_compile.replicate_experts``: an FSDP unit on the experts would break the compiled layer
between its router and its experts, so ``fully_shard_experts`` raises there); gradients are clipped with
``moe_compile.parallel.clip_grad_norm_``, which combines the norms of both meshes (as
tests/test_ep_fsdp.py). ``--grad-checkpointing`` turns on transformers' activation checkpointing in
every run. The eager reference of an ``--ep`` run is the same training without expert
parallelism (expert-parallel layers only run compiled), which computes the same function.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flops import model_flops  # noqa: E402  (examples/flops.py)

SMALL = dict(  # small widths for any MoE architecture (the keys its config has); default: Qwen3-MoE
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
    num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[],
    kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, sliding_window=32)


# ----------------------------------------------------------------------------------------- data
class PermutationData:
    """Learnable token streams: next = perm[token] with probability 1 - noise, else uniform."""

    def __init__(self, vocab: int, seq: int, noise: float, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(vocab, generator=g)
        self.vocab, self.seq, self.noise = vocab, seq, noise

    def batch(self, batch: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = torch.empty(batch, self.seq, dtype=torch.long)
        ids[:, 0] = torch.randint(self.vocab, (batch,), generator=g)
        noise = torch.rand(batch, self.seq, generator=g) < self.noise
        rand = torch.randint(self.vocab, (batch, self.seq), generator=g)
        for t in range(1, self.seq):
            ids[:, t] = torch.where(noise[:, t], rand[:, t], self.perm[ids[:, t - 1]])
        return ids

    def entropy(self) -> float:
        """Per-token entropy of the stream (nats): the lowest loss a model can reach."""
        p_hit = 1 - self.noise + self.noise / self.vocab
        p_miss = self.noise / self.vocab
        return -(p_hit * math.log(p_hit) + (self.vocab - 1) * p_miss * math.log(p_miss)) if self.noise else 0.0


# ----------------------------------------------------------------------------------------- model
def make_config(args):
    """The model's config: a checkpoint's or a config file's as is, else ``--model-type`` at small
    widths (``SMALL``, only the keys that config class has); then ``--set`` / ``--layers``."""
    import transformers

    if args.checkpoint or args.config:
        cfg = transformers.AutoConfig.from_pretrained(args.checkpoint or args.config)
    else:
        default = transformers.AutoConfig.for_model(args.model_type)
        small = {k: v for k, v in SMALL.items() if hasattr(default, k)}
        if "qk_rope_head_dim" in small:  # multi-head latent attention: rotary width = head_dim
            small["head_dim"] = small["qk_rope_head_dim"]
        cfg = transformers.AutoConfig.for_model(args.model_type, **small)
    for key, value in args.set:
        if not hasattr(cfg, key):
            raise SystemExit(f"train.py: --set {key}=...: {type(cfg).__name__} has no field '{key}' (a typo?); "
                             f"its fields: {', '.join(sorted(k for k in cfg.to_dict() if not k.startswith('_')))}")
        setattr(cfg, key, value)
    if args.layers:
        cfg.num_hidden_layers = args.layers
    cfg.use_cache = False
    return cfg


def make_model(args, cfg, device, dtype):
    import transformers

    torch.manual_seed(args.seed)
    if args.checkpoint:
        return _checkpointed(transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, config=cfg, dtype=dtype).to(device).train(), args)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters built in their dtype, on the device
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():  # routers initialised to zero would tie every score
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.endswith(("gate.weight", "router.weight")) and not p.abs().sum():
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return _checkpointed(model.train(), args)


def _checkpointed(model, args):
    if args.grad_checkpointing:   # transformers' activation checkpointing of each decoder layer
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):   # its name from transformers 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def shard(model, args, world: int, device_type: str, ep: int):
    """FSDP2 (+ expert parallelism with ep > 1), in place. Returns the mesh (None on one process)."""
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import moe_compile
    from moe_compile.blocks import find_blocks

    if world % ep:
        raise SystemExit(f"--ep {ep} must divide the number of ranks ({world})")
    mesh = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    flat = init_device_mesh(device_type, (world,), mesh_dim_names=("all",))
    if ep > 1:
        moe_compile.parallelize_experts(model, mesh["ep"])     # each rank keeps E / ep experts
        if world > ep:                                         # ... whole on the ranks holding the same ones
            moe_compile.replicate_experts(model, mesh["dp"])
        else:                                                  # ... out of FSDP (one rank holds each)
            moe_compile.fully_shard_experts(model, mesh["dp"])
    ignored = moe_compile.fsdp_ignored_params(model)           # experts kept out of FSDP (dp = 1: nothing to shard)
    for layer in find_blocks(model):                           # the decoder layers
        fully_shard(layer, mesh=flat, ignored_params=ignored)  # dense parameters over every rank
    fully_shard(model, mesh=flat, ignored_params=ignored)
    return mesh


def compile_model(model, args, label: str):
    """``label``: "eager" (no compile), "stock" (``torch.compile``'s default backend, Inductor) or "moe"."""
    if label == "eager":
        return model
    if label == "stock":
        return torch.compile(model)
    options = {} if args.inductor else {"moe.inductor": False}
    kw = {"options": options} if options else {}
    if args.compile == "blocks":
        import moe_compile

        moe_compile.compile_blocks(model, backend="moe", **kw)
        return model
    return torch.compile(model, backend="moe", **kw)


# ----------------------------------------------------------------------------------------- loop
class Progress:
    """tqdm when installed, else one line rewritten in place."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        self.enabled, self.total, self.desc = enabled, total, desc
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, **stats):
        if not self.enabled:
            return
        text = " ".join(f"{k}={v}" for k, v in stats.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"\r{self.desc} {step}/{self.total} {text}", end="", flush=True)

    def write(self, text: str):
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print("\n" + text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print()


def train(args, cfg, label: str, device, dtype, rank: int, world: int, data: PermutationData) -> list[float]:
    """One training run; returns the loss of every step (mean over ranks)."""
    torch._dynamo.reset()  # each run compiles afresh (torch 2.11 may reuse one backend's code for another)
    model = make_model(args, cfg, device, dtype)
    ep = args.ep if label == "moe" else 1  # expert-parallel layers run only compiled
    shard(model, args, world, device.type, ep)
    fn = compile_model(model, args, label)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    flops = model_flops(model.config, args.batch, args.seq)
    tokens = args.batch * args.seq
    bar = Progress(args.steps, label, enabled=rank == 0)
    losses, t_last = [], None
    for step in range(args.steps):
        ids = data.batch(args.batch, seed=args.seed * 100_003 + step * world + rank).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        if world > 1 or args.clip:
            from moe_compile.parallel import clip_grad_norm_
            clip_grad_norm_(model, args.clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())  # a host sync per step: fine for an example
        dt = time.perf_counter() - t0
        t_last = dt if step == 0 else (0.8 * t_last + 0.2 * dt)  # smoothed; step 0 includes compiling
        stats = dict(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / t_last:,.0f}")
        if flops:
            stats["TFLOP_s"] = f"{flops / t_last / 1e12:.3g}"
        bar.update(step + 1, **stats)
        if step == 0 and label == "moe" and rank == 0:
            import moe_compile
            bar.write(f"backend='moe' rewrote {moe_compile.counters['rewritten']} MoE region(s) in the graphs it "
                      f"compiled on rank 0, refused {moe_compile.counters['refused']} (moe_compile.explain(model, ids) "
                      "says why)" + (" ; every decoder layer runs the first layer's graph" if args.compile == "blocks" else ""))
    bar.close()
    return losses


def deviations(curves: dict) -> dict:
    """(largest, mean) |loss - eager's loss| over the steps, per compiled curve."""
    eager = curves["eager"]
    out = {}
    for name, curve in curves.items():
        if name != "eager":
            diffs = [abs(a - b) for a, b in zip(curve, eager)]
            out[name] = (max(diffs), sum(diffs) / len(diffs))
    return out


def write_curves(out: str, curves: dict, floor: float):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "loss.csv")
    names = list(curves)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step"] + [f"loss_{n}" for n in names])
        for i in range(len(curves[names[0]])):
            w.writerow([i] + [f"{curves[n][i]:.6f}" for n in names])
    print(f"loss curves: {path}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ax.plot(curves[n], label=n)
    ax.axhline(floor, color="gray", ls="--", lw=0.8, label="data entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    print(f"plot: {os.path.join(out, 'loss.png')}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-type", default="qwen3_moe",
                     help="a transformers model type (AutoConfig.for_model); the default is a small Qwen3-MoE")
    src.add_argument("--config", default=None, help="a config.json / model directory (AutoConfig.from_pretrained)")
    src.add_argument("--checkpoint", default=None, help="a local checkpoint directory (from_pretrained)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: 200 on a GPU, 60 on the CPU")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: none)")
    ap.add_argument("--noise", type=float, default=0.1, help="fraction of uniform random tokens in the data")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", default="whole", choices=["whole", "blocks"],
                    help="torch.compile the whole model, or each decoder layer (moe_compile.compile_blocks)")
    ap.add_argument("--inductor", action=argparse.BooleanOptionalAction, default=None,
                    help="compile with Inductor (default: on GPU; on CPU the moe ops run eagerly, for a fast start)")
    ap.add_argument("--amp", action="store_true",
                    help="fp32 parameters, the forward under torch.autocast(bfloat16) (HF Trainer's bf16=True)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (under torchrun)")
    ap.add_argument("--grad-checkpointing", action="store_true",
                    help="transformers' activation checkpointing of every decoder layer (non-reentrant)")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="also train eagerly from the same weights on the same batches (the reference curve)")
    ap.add_argument("--stock", action=argparse.BooleanOptionalAction, default=None,
                    help="also train with stock torch.compile (Inductor), to compare its distance from eager with "
                         "backend='moe''s (default: on a GPU)")
    ap.add_argument("--out", default="train_out", help="directory for loss.csv / loss.png")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    pairs = []
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--set takes KEY=VALUE (a config field and a Python literal), got {item!r}")
        try:
            pairs.append((key, ast.literal_eval(value)))
        except (ValueError, SyntaxError):
            ap.error(f"--set {key}=...: {value!r} is not a Python literal (a number, True/False, a quoted string, "
                     "a list)")
    args.set = pairs
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.noise <= 1:
        ap.error(f"--noise is a fraction of tokens, in [0, 1]; got {args.noise}")
    return args


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if args.ep < 1 or (args.ep > 1 and world == 1):
        raise SystemExit(f"--ep {args.ep}: expert parallelism needs torchrun with a multiple of --ep ranks "
                         "(e.g. torchrun --nproc-per-node 4 examples/train.py --ep 2)")
    if args.inductor is None:
        args.inductor = device.type == "cuda"
    if args.stock is None:
        args.stock = device.type == "cuda"
    if args.steps is None:
        args.steps = 200 if device.type == "cuda" else 60
    dtype = torch.bfloat16 if device.type == "cuda" and not args.amp else torch.float32
    cfg = make_config(args)
    data = PermutationData(vocab=cfg.vocab_size, seq=args.seq, noise=args.noise, seed=args.seed + 1234)
    if rank == 0:
        experts = " (experts replicated over dp)" if args.ep > 1 and world > args.ep else ""
        print(f"{cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}; "
              f"{world} rank(s) on {device.type}, {dtype}{' under autocast(bfloat16)' if args.amp else ''}, "
              f"ep {args.ep}{experts}, compile {args.compile}, "
              f"{'activation checkpointing, ' if args.grad_checkpointing else ''}"
              f"inductor {args.inductor}; loss starts near ln(vocab) = {math.log(data.vocab):.2f}, "
              f"floor (data entropy) {data.entropy():.2f}")
    curves = {"moe": train(args, cfg, "moe", device, dtype, rank, world, data)}
    if args.stock:
        curves["stock"] = train(args, cfg, "stock", device, dtype, rank, world, data)
    if args.eager:
        curves["eager"] = train(args, cfg, "eager", device, dtype, rank, world, data)
    if rank == 0:
        write_curves(args.out, curves, data.entropy())
        last = {k: sum(v[-5:]) / len(v[-5:]) for k, v in curves.items()}
        print("final loss (mean of the last 5 steps): " + ", ".join(f"{k} {v:.4f}" for k, v in last.items()))
        if "eager" in curves:
            for name, dev in deviations(curves).items():
                print(f"|loss_{name} - loss_eager| over {args.steps} steps: max {dev[0]:.3g}, mean {dev[1]:.3g}")
    if world > 1:
        dist.destroy_process_group()
    return curves


if __name__ == "__main__":
    main()
