"""Quickstart: compile a plain-PyTorch MoE language model with backend="moe" and train it.

    python examples/quickstart.py            # CPU works; uses CUDA (bf16) when present

No moe_compile import is needed to compile (the backend is an entry point); we import it only to
print the explain() report.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe_compile


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Mixtral-style sparse MoE written the plain way: a loop over experts."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(num_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(selected == i)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.view(shape)


class TinyMoELM(nn.Module):
    def __init__(self, vocab=256, hidden=64, inter=128, layers=2, num_experts=8, top_k=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(MoE(hidden, inter, num_experts, top_k) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyMoELM().to(device=device, dtype=dtype)
    ids = torch.randint(0, 256, (4, 32), device=device)

    report = moe_compile.explain(model, ids)
    print(report)
    if len(report.rewritten) != len(model.moes):
        raise SystemExit(f"expected {len(model.moes)} rewritten MoE layers, got {len(report.rewritten)}")

    compiled = torch.compile(model, backend="moe")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"\ntraining on {device} ({dtype}) with backend='moe':")
    for step in range(6):
        t0 = time.perf_counter()
        batch = torch.randint(0, 256, (4, 33), device=device)
        logits = compiled(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"  step {step}: loss {loss.item():.4f}  ({time.perf_counter() - t0:.2f}s)")

    with torch.no_grad():
        test = torch.randint(0, 256, (2, 16), device=device)
        got, want = compiled(test).float(), model(test).float()
        err = ((got - want).norm() / want.norm()).item()
    print(f"\ncompiled vs eager on fresh tokens: relative error {err:.1e} ({dtype}; the rewrite accumulates in fp32)")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
