"""Optimizer state that LowRankQHAdam used on its own holds, by knob, against torch's AdamW: the bytes of every
tensor in ``opt.state`` after one step (measured, not modelled), on lordo's ``micro`` GPT (vocabulary 4096) with
the groups of ``lordo.param_groups`` (the block matrices low-rank at r = 16, the rest full-rank).

    python benchmarks/standalone_memory.py
"""

from __future__ import annotations

import torch

import lordo
from lordo.model import GPT, GPTConfig


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    torch.manual_seed(0)
    tokens = torch.randint(0, 4096, (2, 33))
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    opt.step()
    opt.zero_grad()
    return state_bytes(opt)


def main() -> None:
    cfg = GPTConfig(vocab_size=4096, d_model=128, n_layers=4, n_heads=4, seq_len=128)
    rows = []
    torch.manual_seed(0)
    model = GPT(cfg)
    adamw = one_step(model, torch.optim.AdamW(model.parameters()))
    rows.append(("AdamW (torch)", adamw))
    for label, options in (("LowRankQHAdam, error feedback fp32 (default)", {}),
                           ("LowRankQHAdam, error feedback bf16", {"error_feedback_dtype": torch.bfloat16}),
                           ("LowRankQHAdam, error feedback off", {"error_feedback": False}),
                           ("LowRankQHAdam, error feedback off, omega = 1 (GaLore's update)",
                            {"error_feedback": False, "omega": 1.0})):
        torch.manual_seed(0)
        model = GPT(cfg)
        rows.append((label, one_step(model, lordo.LowRankQHAdam(lordo.param_groups(model, rank=16), **options))))
    block = sum(p.numel() for g in lordo.param_groups(GPT(cfg), rank=16)[:1] for p in g["params"])
    print(f"micro: {sum(p.numel() for p in model.parameters()):,} parameters, {block:,} of them in low-rank matrices")
    print("| optimizer | state bytes | × AdamW |\n|---|---|---|")
    for label, b in rows:
        print(f"| {label} | {b:,} | {b / adamw:.2f} |")


if __name__ == "__main__":
    main()
