"""A small PyTorch model trained with strata.optim.CPUAdamW, checked against
torch.optim.AdamW: the same model, initialisation, batches and schedule, the losses
compared step by step. Exits 1 when they differ by more than 1e-4 relative.

    pip install ./python torch
    python examples/python/torch_cpu_adamw.py
"""

import sys

import torch

from strata.optim import CPUAdamW

STEPS = 60


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.GELU(),
        torch.nn.LayerNorm(128),
        torch.nn.Linear(128, 128),
        torch.nn.GELU(),
        torch.nn.Linear(128, 10),
    )


def param_groups(model):
    # Weight decay on matrices only, as GPT-style training does.
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def train(optimizer_class, **kwargs):
    model = make_model()
    opt = optimizer_class(param_groups(model), lr=3e-3, betas=(0.9, 0.95), **kwargs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STEPS)
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=data)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 32, generator=data)
        y = (x @ teacher).argmax(dim=1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def main():
    ours = train(CPUAdamW)
    theirs = train(torch.optim.AdamW)
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        worst = max(worst, abs(a - b) / abs(b))
        if step in (1, 2, 5) or step % 10 == 0:
            print(f"step {step:3d}  loss CPUAdamW {a:.6f}  torch AdamW {b:.6f}")
    print(f"loss {ours[0]:.4f} -> {ours[-1]:.4f}; largest relative difference from torch "
          f"{worst:.2e}")
    if worst > 1e-4 or not ours[-1] < 0.5 * ours[0]:
        print("FAIL: CPUAdamW's losses do not follow torch.optim.AdamW's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
