"""Which settings a checkpoint and the run that resumes it must share: the fields that may change on resume, the
fields added after checkpoints were first written (with the value that behaves as lordo did before them), and the
comparison ``lordo train --resume`` and torchft's workers make."""

from __future__ import annotations

import torch

# fields that may change when a run is resumed; every other field must match the checkpoint's config
RESUMABLE_CHANGES = {
    ("train", "steps"),
    ("train", "eval_every"),
    ("train", "eval_batches"),
    ("train", "eval_model"),
    ("train", "log_every"),
    ("train", "log"),
    ("train", "device"),
    ("train", "compile"),
    ("train", "threads"),
    ("train", "checkpoint_every"),
    ("train", "keep_checkpoints"),
    ("train", "on_nonfinite"),
    ("train", "max_consecutive_skips"),
    ("data", "dir"),
    ("dist", "backend"),
    ("dist", "timeout_s"),
    ("comm", "latency_s"),
    ("comm", "bandwidths_gbit"),
    ("comm", "intra_bandwidth_gbit"),
    ("comm", "medium"),
    ("strategy", "offload_anchor"),
    ("optim", "compile_codec"),  # the same codes compiled or not (tests/test_float8.py)
}


# fields added after checkpoints were first written, with the value that behaves as lordo did before them
ADDED_FIELDS = {
    ("strategy", "error_feedback_after_qh"): "keep",
    ("strategy", "basis_iterations"): 1,
    ("train", "eval_model"): "worker0",
    ("train", "precision"): "fp32",
    ("strategy", "sync_buffers"): True,  # lordo's own model has no persistent buffers: the same either way
    ("train", "max_consecutive_skips"): 20,
    ("data", "corpus"): "bundled",
    ("data", "tokens"): "",
    ("data", "token_dtype"): "uint16",
    ("data", "tokenizer"): "bpe",
    ("data", "text_field"): "text",
    ("dist", "ranks_per_worker"): 1,
    ("strategy", "offload_anchor"): False,
    ("strategy", "sync_delay"): 0,
    ("comm", "medium"): "switched",
    ("strategy", "lowrank_term"): "adam",
    ("strategy", "average_error_feedback"): False,
    ("optim", "compile_step"): False,
    ("strategy", "compress"): "none",
    ("strategy", "compress_feedback"): True,  # nothing to feed back without compression: the same either way
    ("strategy", "error_feedback_dtype"): "float32",
    ("strategy", "moments_dtype"): "float32",
    ("strategy", "lowrank_moments_dtype"): "float32",
    ("strategy", "anchor_dtype"): "float32",
    ("strategy", "compress_residual"): "buffer",
    ("strategy", "memory"): "default",
    ("dist", "shard"): False,
    ("optim", "inner"): "auto",
    # the Muon fields are read only with optim.inner = "muon", which an older run cannot have
    ("optim", "muon_momentum"): 0.95,
    ("optim", "muon_nesterov"): True,
    ("optim", "muon_ns_steps"): 5,
    ("optim", "muon_adjust_lr"): "match_rms_adamw",
    ("optim", "muon_ns_dtype"): "bfloat16",
    ("optim", "muon_qh_scale"): "own",  # what LoRDO's Muon form did before the setting existed
    ("optim", "muon_orthogonalise"): "lowrank",
    # read only with strategy.compress = sparse or basis, which an older run cannot have
    ("strategy", "compress_dense"): "int8",
    ("strategy", "compress_density"): 1 / 64,
    ("strategy", "compress_bits"): 2,
    ("strategy", "compress_fullrank"): "dense",
    # one phase, as every run was before the two-phase protocol
    ("switch", "at_step"): 0,
    ("switch", "sync_every_before"): 0,
    ("switch", "omega"): -1.0,
    ("switch", "beta1"): -1.0,
    ("switch", "beta2"): -1.0,
    ("switch", "reset_moments"): False,
    ("switch", "lr_scale"): 1.0,
}


def with_added_fields(saved: dict) -> dict:
    """``saved`` (a run's config as written) with each field it lacks because it was added later set to the
    value that behaves as lordo did before it (``ADDED_FIELDS``): what ``lordo train --resume`` continues."""
    out = {section: dict(body) if isinstance(body, dict) else body for section, body in saved.items()}
    for (section, key), value in ADDED_FIELDS.items():
        body = out.setdefault(section, {})
        if isinstance(body, dict):
            body.setdefault(key, value)
    return out


def _resolved_auto(config: dict) -> dict:
    """``strategy.basis_method = auto`` and ``train.precision = auto`` as what they stand for (what decides the
    trajectory), so that a checkpoint saved with the explicit value, before auto existed, resumes."""
    strategy, train = config.get("strategy", {}), config.get("train", {})
    if strategy.get("basis_method") == "auto":
        method = "svd" if strategy.get("name") == "lordo-local" else "subspace"
        config = {**config, "strategy": {**strategy, "basis_method": method}}
    if train.get("precision") == "auto":
        cuda = train.get("device") == "cuda" or (train.get("device") == "auto" and torch.cuda.is_available())
        config = {**config, "train": {**train, "precision": "bf16-mixed" if cuda else "fp32"}}
    return config


def trajectory_settings(config: dict) -> dict:
    """The settings of ``config`` that shape the trajectory: what may not differ between a checkpoint and its
    resume, or between the workers of one torchft run (``RESUMABLE_CHANGES`` and ``derived`` left out)."""
    config = _resolved_auto(config)
    return {section: {k: v for k, v in body.items() if (section, k) not in RESUMABLE_CHANGES}
            for section, body in config.items() if section != "derived" and isinstance(body, dict)}


def config_differences(saved: dict, current: dict) -> list[str]:
    """Fields (section.key: saved → current) that differ and may not change on resume. A field the saved
    config lacks because it was added later counts as the value that behaves as before (``ADDED_FIELDS``)."""
    out = []
    saved, current = _resolved_auto(with_added_fields(saved)), _resolved_auto(current)
    for section, body in current.items():
        if section == "derived" or not isinstance(body, dict):
            continue
        for key, value in body.items():
            old = saved.get(section, {}).get(key, "<missing>")
            if old != value and (section, key) not in RESUMABLE_CHANGES:
                out.append(f"{section}.{key}: {old!r} in the checkpoint, {value!r} now")
    return out
