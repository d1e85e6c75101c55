"""A run's whole configuration: the sections together, the rules across them, the model presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from .sections import (
    DEFAULT_LR,
    DEFAULT_OMEGA,
    MUON_OMEGA,
    MUON_STRATEGIES,
    CommConfig,
    DataConfig,
    DistConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    StrategyConfig,
    SwitchConfig,
    TrainConfig,
    outer_settings,
)


@dataclass(kw_only=True)
class Config:
    """A run's complete settings, one dataclass per section; build it with :func:`build_config`, which
    validates every field. ``lordo train --help`` (or docs/cli.md) lists every key with its default."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    switch: SwitchConfig = field(default_factory=SwitchConfig)

    def __post_init__(self) -> None:
        for section, cls in _section_types().items():
            if not isinstance(getattr(self, section), cls):
                raise ConfigError(f"Config.{section} must be a {cls.__name__}, got {type(getattr(self, section)).__name__}")
        if self.strategy.sync_delay and self.strategy.name in ("ddp", "lowrank-ddp"):
            raise ConfigError(
                f"strategy.sync_delay applies to the synchronisations of local-adam, lordo, lordo-global-noqh and "
                f"lordo-local; strategy {self.strategy.name!r} communicates every step (set strategy.sync_delay = 0)"
            )
        if self.strategy.sync_delay > self.strategy.sync_every:
            raise ConfigError(f"strategy.sync_delay must be in [0, strategy.sync_every = {self.strategy.sync_every}], "
                              f"got {self.strategy.sync_delay}")
        if self.strategy.compress != "none" and self.strategy.name in ("ddp", "lowrank-ddp"):
            raise ConfigError(
                f"strategy.compress applies to the synchronisations of local-adam, lordo, lordo-global-noqh and "
                f"lordo-local; strategy {self.strategy.name!r} has none (set strategy.compress = \"none\")"
            )
        if self.strategy.compress in ("sparse", "basis"):
            self._check_sparse()
        self._resolve("strategy.omega", -1, default_omega(self))  # -1: the form's own
        if self.strategy.memory == "lean":
            self._apply_lean()
        self._check_storage()
        if self.optim.inner == "muon":
            self._check_muon()
        if self.dist.backend == "torchft":
            self._check_torchft()
        if self.dist.shard:
            self._check_shard()
        self._check_switch()
        if self.schedule.warmup_steps >= self.train.steps and self.schedule.warmup_steps > 0:
            raise ConfigError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) must be smaller than train.steps "
                f"({self.train.steps})"
            )
        # optim.lr = 0: the strategy's default
        self._resolve("optim.lr", 0, DEFAULT_LR[self.strategy.name])

    def _resolve(self, name: str, unset: float, value: float) -> None:
        """``name`` (section.field) at ``unset`` takes ``value``, and is resolved again when a built config is
        validated again after what ``value`` depends on changed (unless the field was set meanwhile); what was
        resolved is an attribute, not a field: not in config.json."""
        section, key = name.split(".")
        obj, mark = getattr(self, section), f"_resolved_{key}"
        resolved = getattr(self, mark, None)
        if getattr(obj, key) == unset or (resolved is not None and getattr(obj, key) == resolved):
            setattr(obj, key, value)
            setattr(self, mark, value)
        else:
            setattr(self, mark, None)

    def _check_sparse(self) -> None:
        s = self.strategy
        if s.compress == "basis" and s.name not in ("lordo", "lordo-global-noqh"):
            has = "its own bases per worker" if s.name == "lordo-local" else "no bases"
            raise ConfigError(f"strategy.compress = \"basis\" sends coefficients in the basis every worker shares: it "
                              f"needs lordo or lordo-global-noqh ({s.name!r} has {has}); use compress = \"sparse\"")
        if self.dist.backend == "torchft":
            raise ConfigError(f"strategy.compress = {s.compress!r} all-gathers sparse payloads; dist.backend = \"torchft\" "
                              "only averages: use compress = none or bf16")
        if self.dist.ranks_per_worker > 1:
            raise ConfigError(f"strategy.compress = {s.compress!r} encodes each worker's whole pseudo-gradient; workers of "
                              "several ranks (dist.ranks_per_worker > 1) exchange shards: use compress = none, bf16, int8 "
                              "or int4")

    def _apply_lean(self) -> None:
        """``strategy.memory = "lean"``: each storage field still at its default takes its lean value, where the
        strategy keeps that state (LEAN)."""
        s = self.strategy
        for key, (value, applies) in LEAN.items():
            default = next(f.default for f in fields(StrategyConfig) if f.name == key)
            if getattr(s, key) == default and applies(self):
                object.__setattr__(s, key, value)

    def _check_storage(self) -> None:
        """How the state is stored (anchor_dtype, moments_dtype, lowrank_moments_dtype, error_feedback_dtype): where
        each applies."""
        s = self.strategy
        if s.anchor_dtype != "float32":
            if s.name in ("ddp", "lowrank-ddp"):
                raise ConfigError(f"strategy.anchor_dtype applies to the local-update strategies, which keep an anchor; "
                                  f"{s.name!r} has none (leave it float32)")
            if outer_settings(s) != (1.0, 0.0):
                raise ConfigError(f"strategy.anchor_dtype = {s.anchor_dtype!r} is exact only with plain averaging "
                                  "(outer_lr = 1, outer_momentum = 0; diloco has 0.7 and 0.9): an outer momentum would carry "
                                  "the anchor's rounding into the model. Use anchor_dtype = \"float32\" there")
        if s.error_feedback_dtype not in ("float32", "bfloat16"):  # a compact format (int8, int4, fp8)
            if self.optim.compile_step:
                raise ConfigError(f"strategy.error_feedback_dtype = {s.error_feedback_dtype!r} steps each matrix alone; "
                                  "optim.compile_step = true compiles the batched step: leave it false")
            if s.average_error_feedback:
                raise ConfigError(f"strategy.average_error_feedback averages E in place, which error_feedback_dtype = "
                                  f"{s.error_feedback_dtype!r} holds compact: use float32 or bfloat16 with it")
        if s.lowrank_moments_dtype != "float32":
            if s.name not in LOWRANK_OPTIMIZER:
                raise ConfigError(f"strategy.lowrank_moments_dtype = {s.lowrank_moments_dtype!r} applies to LoRDO's inner "
                                  f"optimizer ({', '.join(LOWRANK_OPTIMIZER)}); {s.name!r} has no low-rank moments")
            if self.optim.inner == "muon":
                raise ConfigError("strategy.lowrank_moments_dtype holds Adam's low-rank moments compact; LoRDO's Muon "
                                  "form (optim.inner = \"muon\") keeps its momentum in float32: leave it float32")
            if self.optim.compile_step:
                raise ConfigError(f"strategy.lowrank_moments_dtype = {s.lowrank_moments_dtype!r} steps each matrix alone; "
                                  "optim.compile_step = true compiles the batched step: leave it false")
        if s.moments_dtype != "float32" and s.average_moments == "all":
            raise ConfigError("strategy.average_moments = \"all\" averages the full-rank moments in place, which "
                              f"moments_dtype = {s.moments_dtype!r} holds compact: use average_moments = auto or lowrank")

    def _check_muon(self) -> None:
        if self.strategy.name not in MUON_STRATEGIES:  # the low-rank strategies: LoRDO's Muon form (LowRankMuon)
            if self.optim.compile_step or self.strategy.lowrank_term != "adam":
                raise ConfigError("optim.inner = \"muon\" (LoRDO's Muon form, LowRankMuon) runs per matrix with its own "
                                  "low-rank term: leave optim.compile_step = false and strategy.lowrank_term = \"adam\"")
            s = self.strategy
            if self.optim.muon_orthogonalise == "split" and not (
                    s.error_feedback and s.qh_source == "grad+error" and s.error_feedback_after_qh == "remove"):
                raise ConfigError("optim.muon_orthogonalise = \"split\" (LoRDO's Muon form, the default) keeps the "
                                  "momentum outside the basis in the error feedback: it needs strategy.error_feedback = "
                                  "true, strategy.qh_source = \"grad+error\" and strategy.error_feedback_after_qh = "
                                  "\"remove\" (the defaults); with other settings use optim.muon_orthogonalise = "
                                  "\"lowrank\" (or \"whole\")")
            return
        if self.strategy.average_moments not in ("auto", "none"):
            raise ConfigError(f"strategy.average_moments = {self.strategy.average_moments!r} averages Adam moments, which "
                              "Muon's matrices do not have (optim.inner = \"muon\"): use auto or none")

    def _check_switch(self) -> None:
        """The two-phase protocol (switch.*): what it changes must exist in this run, and it follows a synchronisation."""
        w, s = self.switch, self.strategy
        if not w.active:
            changed = [f.name for f in fields(SwitchConfig) if f.name != "at_step" and getattr(w, f.name) != f.default]
            if changed:
                raise ConfigError(f"switch.{changed[0]} is set but switch.at_step = 0 (one phase): set switch.at_step to "
                                  "the first phase's last step")
            return
        if w.at_step >= self.train.steps:
            raise ConfigError(f"switch.at_step ({w.at_step}) must be smaller than train.steps ({self.train.steps})")
        for period, name in ((s.sync_every, "strategy.sync_every"), (w.sync_every_before, "switch.sync_every_before")):
            if period and s.name != "ddp" and w.at_step % period:
                raise ConfigError(f"switch.at_step ({w.at_step}) must be a multiple of {name} ({period}): the switch "
                                  "follows a synchronisation")
        if w.sync_every_before and s.name in ("ddp", "lowrank-ddp"):
            raise ConfigError(f"switch.sync_every_before sets the local-update strategies' K; {s.name!r} communicates "
                              "every step (leave it 0)")
        if w.omega != -1 and s.name not in ("lordo", "lordo-local"):
            raise ConfigError(f"switch.omega applies to lordo and lordo-local (the strategies with LoRDO's full-rank "
                              f"term); {s.name!r} has none (leave it -1)")
        if self.optim.inner == "muon" and (w.beta1 != -1 or w.beta2 != -1 or w.reset_moments):
            raise ConfigError("switch.beta1, beta2 and reset_moments change Adam's moments; with optim.inner = \"muon\" "
                              "the matrices hold Muon's momentum: leave them unset")
        if w.reset_moments and self.optim.compile_step:
            raise ConfigError("switch.reset_moments does not take optim.compile_step = true (the batched state): leave "
                              "compile_step false")
        other = ("strategy.sync_delay > 0 (a round in flight at the switch)" if s.sync_delay else
                 "dist.backend = \"torchft\"" if self.dist.backend == "torchft" else
                 "dist.shard = true" if self.dist.shard else None)
        if other:
            raise ConfigError(f"switch.at_step > 0 (two phases) is not built with {other}: set switch.at_step = 0")

    def _check_torchft(self) -> None:
        """Under torchft each worker decides alone between synchronisations: nothing may make one skip a step
        the others take (their rounds would no longer meet)."""
        if self.train.on_nonfinite != "stop":
            raise ConfigError("dist.backend = \"torchft\" needs train.on_nonfinite = \"stop\" (a worker that skipped a "
                              "step alone would miss the others' synchronisations; one that stops is recovered)")
        if self.train.precision == "fp16-mixed":
            raise ConfigError("dist.backend = \"torchft\" does not take train.precision = \"fp16-mixed\" (a loss-scaling "
                              "skip on one worker would desynchronise the rounds); use bf16-mixed")
        if self.dist.ranks_per_worker != 1:
            raise ConfigError("dist.backend = \"torchft\" runs one process per worker (dist.ranks_per_worker = 1)")

    def _check_shard(self) -> None:
        """FSDP2 inside a worker: the settings it runs with (docs/multi-node.md)."""
        if self.dist.ranks_per_worker < 2:
            raise ConfigError("dist.shard = true shards each worker's model over its ranks: set dist.ranks_per_worker >= 2")
        if self.dist.backend in ("sim", "torchft"):
            raise ConfigError(f"dist.shard = true runs under torch.distributed (dist.backend gloo, nccl or auto), not "
                              f"{self.dist.backend!r}")
        if self.strategy.name in ("ddp", "lowrank-ddp"):
            raise ConfigError(f"dist.shard = true runs the local-update strategies (local-adam, lordo, lordo-local, "
                              f"lordo-global-noqh), not {self.strategy.name!r}")
        if self.train.compile or self.train.precision == "fp16-mixed":
            raise ConfigError("dist.shard = true does not take train.compile = true or train.precision = \"fp16-mixed\"")
        if self.optim.inner == "muon":
            raise ConfigError("dist.shard = true does not take optim.inner = \"muon\": Newton-Schulz orthogonalises a whole "
                              "matrix, and each rank holds only a shard of its rows; use optim.inner = \"auto\" (Adam) "
                              "with dist.shard, or dist.shard = false with Muon")
        if self.optim.compile_step:
            raise ConfigError("dist.shard = true steps each matrix's shard on its own (the per-matrix path): "
                              "optim.compile_step = true would not apply; leave it false")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


LOWRANK_OPTIMIZER = ("lordo", "lordo-global-noqh", "lordo-local", "lowrank-ddp")  # LowRankQHAdam inside
# strategy.memory = "lean": field -> (value, whether it applies to a config); docs/results.md has the gates
LEAN: dict[str, tuple[Any, Any]] = {
    "anchor_dtype": ("int8", lambda c: c.strategy.name not in ("ddp", "lowrank-ddp")
                     and outer_settings(c.strategy) == (1.0, 0.0)),
    "error_feedback_dtype": ("int8", lambda c: c.strategy.name in LOWRANK_OPTIMIZER and not c.optim.compile_step
                             and not c.strategy.average_error_feedback),
    # the full-rank moments of LoRDO's inner optimizer; MuLoCo's 8-bit inner state (local-adam with Muon inside,
    # strategy.moments_dtype = "int8") missed its gate (+1.6 % on seed 0, docs/results.md) and stays opt-in
    "moments_dtype": ("int8", lambda c: c.strategy.name in LOWRANK_OPTIMIZER and c.strategy.average_moments != "all"),
    "lowrank_moments_dtype": ("int8", lambda c: c.strategy.name in LOWRANK_OPTIMIZER and c.optim.inner != "muon"
                              and not c.optim.compile_step),
    "compress_residual": ("model", lambda c: c.strategy.compress != "none"),
}


def default_omega(cfg: Config) -> float:
    """strategy.omega's value when left at -1: MUON_OMEGA for lordo with LoRDO's split Muon form, else the paper's."""
    o = cfg.optim
    if cfg.strategy.name == "lordo" and o.inner == "muon" and o.muon_orthogonalise == "split":
        return MUON_OMEGA
    return DEFAULT_OMEGA


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


SECTIONS: dict[str, type] = _section_types()

# Shape presets. vocab_size comes from the tokenizer, so parameter counts below are for vocab 4096.
PRESETS: dict[str, dict[str, int]] = {
    "nano": dict(d_model=32, n_layers=2, n_heads=2, seq_len=64),  # ~0.16M, for tests
    "micro": dict(d_model=128, n_layers=4, n_heads=4, seq_len=128),  # ~1.4M
    "small": dict(d_model=256, n_layers=6, n_heads=8, seq_len=256),  # ~5.9M
    "paper-16m": dict(d_model=256, n_layers=4, n_heads=4, seq_len=256),  # the paper's smallest shape, ~4.3M
}
