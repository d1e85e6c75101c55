"""A bound checked before a run allocates anything: what it needs at the least, against the memory there is.

The bound counts only what a run cannot do without (each hosted worker's weights, gradients and anchor, and one
step's logits with their gradient), so it never refuses a run that fits; a run whose settings ask for far more
(a huge ``train.batch_size``, ``dist.workers`` or ``model.d_model``) is refused with the numbers and the keys to
lower, instead of an allocator's traceback minutes in.
"""

from __future__ import annotations

import os

import torch

from ..config import Config
from ..errors import ConfigError
from ..model import GPTConfig


def parameter_count(cfg: Config, vocab_size: int) -> int:
    """The model's parameters, counted from its shape (nothing built, nothing allocated)."""
    m = cfg.model
    return GPTConfig(vocab_size=vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
                     seq_len=m.seq_len, ffn_hidden=m.ffn_hidden).num_params


def least_bytes(cfg: Config, vocab_size: int, hosted: int) -> int:
    """Bytes this process needs at the least: per hosted worker, weights, gradients and anchor in float32, and
    one step's logits and their gradient."""
    per_worker = 3 * 4 * parameter_count(cfg, vocab_size)
    per_worker += 2 * 4 * cfg.train.batch_size * cfg.model.seq_len * vocab_size
    return hosted * per_worker


def available_bytes(device: torch.device) -> int | None:
    """The memory of ``device``: the GPU's total, or the machine's physical memory; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platforms without sysconf
        return None


def check_fits(cfg: Config, vocab_size: int, hosted: int, device: torch.device) -> None:
    have = available_bytes(device)
    if have is None:
        return
    need = least_bytes(cfg, vocab_size, hosted)
    if need > have:
        gib = 2**30
        raise ConfigError(
            f"this run needs at least {need / gib:,.1f} GiB on {device.type} (weights, gradients and anchor of "
            f"{hosted} worker(s) hosted here, {parameter_count(cfg, vocab_size):,} parameters each, and one step's "
            f"logits) but the {'GPU' if device.type == 'cuda' else 'machine'} has {have / gib:,.1f} GiB; lower "
            f"train.batch_size ({cfg.train.batch_size}), model.d_model ({cfg.model.d_model}), model.n_layers "
            f"({cfg.model.n_layers}) or the workers this process hosts (dist.workers = {cfg.dist.workers})"
        )
