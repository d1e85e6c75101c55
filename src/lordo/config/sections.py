"""The config's sections: one dataclass each, checking its fields when constructed (types coerced, each
value against its allowed ones); :class:`~lordo.config.Config` holds them and checks the rules across them."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError
from .fields import Section, choice, fraction, non_negative, or_minus_one, positive, setting, unit_closed, unit_open


@dataclass(kw_only=True)
class ModelConfig(Section):
    _name = "model"
    preset: str = setting("micro", "size preset; its values fill every shape field not set explicitly")
    d_model: int = setting(128, "residual width", positive)
    n_layers: int = setting(4, "transformer blocks", positive)
    n_heads: int = setting(4, "attention heads (d_model must be divisible by it)", positive)
    seq_len: int = setting(128, "context length in tokens", positive)
    ffn_hidden: int = setting(0, "SwiGLU hidden width; 0 = 8/3·d_model rounded up to a multiple of 64", non_negative)
    rope_theta: float = setting(10000.0, "RoPE base", positive)
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", positive)
    init_std: float = setting(0.02, "std of the normal weight init", positive)

    def _check(self) -> None:
        if self.d_model % self.n_heads:
            raise ConfigError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError(f"model.d_model / model.n_heads must be even for RoPE, got {self.d_model // self.n_heads}")


@dataclass(kw_only=True)
class DataConfig(Section):
    _name = "data"
    dir: str = setting("data", "folder holding package archives (packages/, debs/) and prepared token files (prepared/)")
    corpus: str = setting("bundled", "what to train on: bundled (Shakespeare + King James, 2.6M tokens), large (the bundled "
                          "texts plus Debian's free English texts, fetched once by `lordo data fetch --corpus large`), or "
                          "a folder, file or glob of .txt, .md, .jsonl, .parquet or .arrow files (a Hugging Face datasets "
                          "folder: its .arrow files; tables need pyarrow)")
    tokens: str = setting("", "a folder of pre-tokenized train.bin and val.bin (flat arrays of data.token_dtype, ids "
                          "below data.vocab_size) to train on instead of data.corpus")
    token_dtype: str = setting("uint16", "element type of data.tokens' files", choice("uint16", "uint32"))
    tokenizer: str = setting("bpe", "bpe (a byte-level BPE of data.vocab_size trained on the corpus) or a tokenizers JSON "
                             "file (its vocabulary then sets the size)")
    vocab_size: int = setting(4096, "vocabulary size: of the BPE to train (at most 65535), or of data.tokens' ids")
    val_fraction: float = setting(0.05, "share of documents held out for validation (chosen by a hash of their id)")
    text_field: str = setting("text", "the field of each .jsonl line, or the column of each .parquet / .arrow table, that "
                              "holds its text")

    def _check(self) -> None:
        if self.tokens:
            limit = 2**16 if self.token_dtype == "uint16" else 2**32
            if not 1 < self.vocab_size <= limit:
                raise ConfigError(f"data.vocab_size must be in (1, {limit}] for {self.token_dtype} token files, "
                                  f"got {self.vocab_size}")
        elif self.tokenizer == "bpe" and not 256 < self.vocab_size <= 65535:
            raise ConfigError(
                f"data.vocab_size must be in (256, 65535] (byte alphabet plus merges, uint16 storage), got {self.vocab_size}"
            )
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        from pathlib import Path

        if Path(self.dir).exists() and not Path(self.dir).is_dir():
            raise ConfigError(f"data.dir (--data-dir) must be a folder (it holds packages/ and prepared/), got the file "
                              f"{self.dir!r}; to train on your own text files use data.corpus = \"{self.dir}\"")


MUON_STRATEGIES = ("ddp", "local-adam", "diloco")  # the strategies whose inner optimizer optim.inner may change


@dataclass(kw_only=True)
class OptimConfig(Section):
    _name = "optim"
    lr: float = setting(0.0, "peak learning rate; 0 = the strategy's default: 6e-3 for lordo-global-noqh, 3e-3 for the "
                        "others (the better of 3e-3 and 6e-3 for each on micro at 2,000 steps, "
                        "sweeps/long-stagnation.toml)", non_negative)
    beta1: float = setting(0.9, "Adam beta1", unit_open)
    beta2: float = setting(0.999, "Adam beta2", unit_open)
    eps: float = setting(1e-8, "Adam epsilon", positive)
    weight_decay: float = setting(0.1, "decoupled weight decay (matrices only; norms never decay)", non_negative)
    grad_clip: float = setting(0.5, "global gradient-norm clip; 0 disables", non_negative)
    compile_codec: bool = setting(False, "encode and decode the fp8 states (moments_dtype, lowrank_moments_dtype or "
                                  "error_feedback_dtype fp8) through torch.compile: the same codes, several times faster; "
                                  "compiled once per process (tens of seconds; on the CPU it needs a C++ compiler); no effect where no "
                                  "state is fp8")
    compile_step: bool = setting(False, "run the low-rank optimizer step batched over matrix shapes and through "
                                 "torch.compile (compiled at the first steps; on the CPU it needs a C++ compiler)")
    inner: str = setting("auto", "the inner optimizer: auto (the strategy's own: AdamW for ddp, local-adam and diloco, "
                         "LowRankQHAdam for the others) or muon (ddp, local-adam, diloco: torch.optim.Muon on the block "
                         "matrices, AdamW on embeddings, head, norms and biases; the low-rank strategies: LoRDO's Muon "
                         "form, LowRankMuon)", choice("auto", "muon"))
    muon_momentum: float = setting(0.95, "Muon's momentum (optim.inner = muon; in the low-rank strategies it replaces "
                                   "optim.beta1 for the block matrices)", unit_open)
    muon_nesterov: bool = setting(True, "Muon's Nesterov momentum (optim.inner = muon)")
    muon_ns_steps: int = setting(5, "Muon's Newton-Schulz iterations (optim.inner = muon)", positive)
    muon_adjust_lr: str = setting("match_rms_adamw", "Muon's per-matrix rate: match_rms_adamw (0.2 sqrt(max(p, q)) times "
                                  "optim.lr, so AdamW's rate and decay carry over) or original (sqrt(max(1, p/q)))",
                                  choice("match_rms_adamw", "original"))
    muon_ns_dtype: str = setting("bfloat16", "precision of Muon's Newton-Schulz iteration (optim.inner = muon): bfloat16 "
                                 "(torch's) or float32 (for CPUs without bfloat16 matrix units, where bfloat16 GEMMs are an "
                                 "order of magnitude slower)", choice("bfloat16", "float32"))
    muon_qh_scale: str = setting("momentum", "LoRDO's Muon form (optim.inner = muon, low-rank strategies): what the full-rank "
                                 "term is divided by before it takes the orthogonalised step's RMS: momentum (the RMS of "
                                 "the momentum Newton-Schulz normalised, so the term weighs against the low-rank step as in "
                                 "Adam's form) or own (its own RMS: the term's size is fixed at (1 - omega) of the step)",
                                 choice("momentum", "own"))
    muon_orthogonalise: str = setting("split", "LoRDO's Muon form (optim.inner = muon, low-rank strategies): what Newton-Schulz "
                                      "runs on: split (the default: full-rank Muon on the momentum split in two, inside the "
                                      "basis the low-rank momentum, outside it the error feedback E read as an omega-average; "
                                      "needs the default error feedback), lowrank (the r-dimensional momentum, the full-rank "
                                      "term added beside it, scaled: the first form, 1.3x split's perplexity at micro) or whole (the "
                                      "p x q step omega back(N)/|N| + (1 - omega) Q/|Q|, at Muon's own rate); the state stays "
                                      "low-rank in each; split and whole cost full-rank Muon's iteration per step",
                                      choice("lowrank", "whole", "split"))


@dataclass(kw_only=True)
class ScheduleConfig(Section):
    _name = "schedule"
    kind: str = setting("cosine", "learning-rate schedule", choice("cosine", "wsd", "constant"))
    warmup_steps: int = setting(-1, "linear warm-up steps from 0 to the peak lr; -1 = min(50, train.steps // 10)",
                                lambda v: None if v >= -1 else "must be >= 0 (or -1: automatic)")
    min_lr_ratio: float = setting(0.1, "final lr as a fraction of the peak (cosine, wsd)", unit_closed)
    decay_fraction: float = setting(0.2, "wsd: share of the steps spent in the final linear decay", unit_closed)


@dataclass(kw_only=True)
class TrainConfig(Section):
    _name = "train"
    steps: int = setting(600, "optimizer steps", positive)
    batch_size: int = setting(16, "sequences per step (per worker)", positive)
    seed: int = setting(0, "seed of the model init and the batch sampler",
                        lambda v: None if 0 <= v < 2**63 else "must be in [0, 2**63)")
    eval_every: int = setting(100, "evaluate the validation loss every N steps (and at the end)", positive)
    eval_batches: int = setting(16, "fixed validation batches per evaluation", positive)
    eval_model: str = setting("average", "which model an evaluation between synchronisations scores: average (the mean "
                              "of every worker's parameters, the model a synchronisation would give; an extra all-reduce "
                              "not counted in the ledger) or worker0 (worker 0's own drifting model, no communication)",
                              choice("average", "worker0"))
    log_every: int = setting(10, "write a metrics row every N steps", positive)
    device: str = setting("auto", "auto = cuda if available, else cpu", choice("auto", "cpu", "cuda"))
    compile: bool = setting(False, "torch.compile the model")
    precision: str = setting("auto", "fp32; bf16-mixed (bfloat16 autocast, float32 weights and optimizer state); bf16 "
                             "(bfloat16 weights; optimizer moments stay float32); fp16-mixed (float16 autocast with a "
                             "gradient scaler); auto = bf16-mixed on CUDA, fp32 on CPU",
                             choice("auto", "fp32", "bf16-mixed", "bf16", "fp16-mixed"))
    threads: int = setting(0, "torch intra-op threads; 0 = torch's default", non_negative)
    checkpoint_every: int = setting(250, "save a checkpoint every N steps (also at the end and on SIGTERM/SIGINT); 0 = "
                                    "only then", non_negative)
    keep_checkpoints: int = setting(2, "how many of the newest checkpoints to keep", positive)
    log: str = setting("jsonl", "where metrics go: jsonl (OUT/metrics.jsonl, always written) or tensorboard (also "
                       "TensorBoard event files in OUT/tensorboard; needs pip install 'lordo[tb]')",
                       choice("jsonl", "tensorboard"))
    max_consecutive_skips: int = setting(20, "with on_nonfinite = skip: stop after this many skipped steps in a row (a "
                                         "diverged model skips every step)", positive)
    on_nonfinite: str = setting("stop", "a NaN/inf loss on any worker: stop (naming the last good checkpoint) or skip "
                                "the step on every worker", choice("stop", "skip"))


# The strategies by name, with the learning rate optim.lr = 0 resolves to: the better of {3e-3, 6e-3} for each
# on micro at 2,000 steps (docs/results.md; at 200 steps the low-rank strategies preferred 6e-3).
# strategies.build has a builder for each name.
DEFAULT_LR = {"ddp": 3e-3, "local-adam": 3e-3, "diloco": 3e-3, "lordo": 3e-3, "lordo-global-noqh": 6e-3,
              "lordo-local": 3e-3, "lowrank-ddp": 3e-3}  # diloco: local-adam's inner rate, not tuned for it
STRATEGY_NAMES = tuple(DEFAULT_LR)
# strategy.omega = -1: Adam's form takes the paper's 0.98; lordo with LoRDO's split Muon form 0.95, ahead of 0.98 at
# micro and paper-16m on two seeds each (docs/results.md section 13)
DEFAULT_OMEGA, MUON_OMEGA = 0.98, 0.95


@dataclass(kw_only=True)
class StrategyConfig(Section):
    _name = "strategy"
    name: str = setting("lordo", "what happens after backward: ddp (AdamW on the averaged gradient every step), "
                        "local-adam (K local AdamW steps, then average: Local Adam / DES-LOC), diloco (local-adam with DiLoCo's outer "
                        "Nesterov momentum: outer_lr 0.7, outer_momentum 0.9 unless set), lordo (global low-rank basis + "
                        "full-rank QH term), lordo-global-noqh (omega = 1), lordo-local (per-worker bases), "
                        "lowrank-ddp (projected gradients all-reduced every step)", choice(*STRATEGY_NAMES))
    sync_every: int = setting(32, "K: local steps between synchronisations (lowrank-ddp: steps between basis refreshes)",
                              positive)
    sync_delay: int = setting(0, "tau: local steps a synchronisation runs behind before it lands, 0 <= tau <= sync_every "
                              "(0 = every worker waits for it; > 0: the next steps train meanwhile and the round is merged "
                              "with them, docs/concepts.md); local-update strategies, one process per worker",
                              non_negative)
    outer_lr: float = setting(1.0, "outer step size on the averaged pseudo-gradient (1 = model averaging)", positive)
    outer_momentum: float = setting(0.0, "outer SGD momentum (0 = none; DiLoCo uses 0.9 with outer_lr 0.7)", unit_open)
    outer_nesterov: bool = setting(True, "Nesterov form of the outer momentum (when outer_momentum > 0)")
    average_moments: str = setting("auto", "optimizer moments averaged over workers: auto (none for local-adam and "
                                   "lordo-local, the low-rank ones for lordo and lordo-global-noqh), none, lowrank, all",
                                   choice("auto", "none", "lowrank", "all"))
    sync_exp_avg_every: int = setting(0, "period in steps of averaging first moments; 0 = at every sync", non_negative)
    sync_exp_avg_sq_every: int = setting(0, "period in steps of averaging second moments; 0 = at every sync", non_negative)
    rank: int = setting(16, "r: rank of the low-rank moments (1 <= r <= min(p, q) of every low-rank matrix)", positive)
    omega: float = setting(-1.0, "QH weight on the low-rank momentum; 1 - omega goes to the raw full-rank gradient "
                           "(lordo-global-noqh and lowrank-ddp use 1); -1 = the form's own: 0.95 for lordo with LoRDO's "
                           "split Muon form (optim.inner = muon), 0.98 otherwise (Adam's form, the paper's)",
                           or_minus_one(unit_closed, "automatic"))
    error_feedback: bool = setting(True, "feed what the projection drops back into the next step's gradient")
    basis_method: str = setting("auto", "how bases are computed at a synchronisation: auto (svd for lordo-local, the paper's "
                                "LoRDO-Local: each worker's basis afresh from its own gradient; subspace otherwise), subspace "
                                "(iteration warm-started from the previous basis: 16-19x faster, the same quality for a global "
                                "basis in docs/performance.md; with lordo-local the warm local variant, docs/concepts.md) or "
                                "exact svd (initial bases are always exact)", choice("auto", "svd", "subspace"))
    qh_source: str = setting("grad+error", "input of the full-rank QH term: G + error feedback (grad+error, the research "
                             "code's form and the default: it moves the global basis) or the clipped gradient G alone (grad, the "
                             "paper's notation: the basis barely moves; docs/results.md)", choice("grad", "grad+error"))
    error_feedback_after_qh: str = setting("remove", "with qh_source = grad+error: what the full-rank term applied of the "
                                           "error feedback E each step is removed from E (remove, the default: E <- omega * E, "
                                           "bounded) or stays in it too (keep: the research code)", choice("keep", "remove"))
    basis_iterations: int = setting(1, "subspace-iteration steps per basis refresh (basis_method = subspace)", positive)
    lowrank_term: str = setting("adam", "the low-rank part of each local step: adam (omega * back(m/(sqrt(v) + eps)), the "
                                "paper's formula) or momentum (omega * back(m), not divided: the authors' research code; "
                                "tune its learning rate, configs/research-step.toml)", choice("adam", "momentum"))
    average_error_feedback: bool = setting(False, "lordo, lordo-local: average the error-feedback buffers E over the workers "
                                           "at each synchronisation (full-size: as many bytes again as the pseudo-gradient; "
                                           "the research code may do it)")
    compress: str = setting("none", "payload of the synchronisations of local-update strategies: none (fp32), bf16 "
                            "(pseudo-gradient and moments all-reduced in bfloat16), int8 or int4 (pseudo-gradient quantised in "
                            "blocks of 256 / 128 elements with a float32 scale each and averaged by a quantised reduce-scatter "
                            "and all-gather; averaged moments in int8, second moments in the log domain), sparse (chunk-wise "
                            "top-k of the pseudo-gradient, strategy.compress_density and _bits, all-gathered) or basis "
                            "(lordo, lordo-global-noqh: each low-rank matrix's pseudo-gradient as its coefficients in the "
                            "shared basis, through strategy.compress_dense, plus a sparse residual)",
                            choice("none", "bf16", "int8", "int4", "sparse", "basis"))
    compress_dense: str = setting("int8", "compress = sparse or basis: the codec of what travels dense (the coefficients in the "
                                  "basis, the averaged moments, full-rank tensors with compress_fullrank = dense): none, bf16, "
                                  "int8 or int4", choice("none", "bf16", "int8", "int4"))
    compress_density: float = setting(1 / 64, "compress = sparse or basis: the fraction of each chunk of 4,096 elements "
                                      "sent (its largest magnitudes), in (0, 1]", fraction)
    compress_bits: int = setting(2, "compress = sparse or basis: bits per sent value (2, 4 or 8; indices take 12)",
                                 choice(2, 4, 8))
    compress_fullrank: str = setting("dense", "compress = basis: full-rank tensors (embedding, norms) dense, with the "
                                     "coefficients, or through the sparse codec", choice("dense", "sparse"))
    compress_feedback: bool = setting(True, "keep what compressing the pseudo-gradient lost on each worker and add it to "
                                      "the next round's (error feedback), so nothing is lost over rounds")
    memory: str = setting("default", "lean: every storage choice that kept perplexity within its gate at 2,000 steps "
                          "(docs/results.md, 'Less memory'): the fields below that are at their defaults become "
                          "anchor_dtype int8, error_feedback_dtype int8, moments_dtype int8 (LoRDO's strategies), "
                          "lowrank_moments_dtype int8 and compress_residual model, where the strategy has them; default: "
                          "as each field says", choice("default", "lean"))
    compress_residual: str = setting("buffer", "where what compressing the pseudo-gradient lost waits for the next round "
                                     "(compress_feedback = true): buffer (a float32 buffer per worker, as large as the model) "
                                     "or model (folded into the worker's model after the round: it starts the next round at "
                                     "θ_new − e, so its next pseudo-gradient carries e; no buffer)", choice("buffer", "model"))
    error_feedback_dtype: str = setting("float32", "storage of the low-rank projections' error-feedback buffers (the largest "
                                        "state LoRDO keeps): float32, bfloat16 (half), int8 or int4 (8 or 4 bits per element "
                                        "with a scale per block: about a quarter or an eighth; the step computes in float32), "
                                        "or fp8 (e4m3 per block of 256: int8's bytes, encoded without int8's table lookups, "
                                        "at about twice its rounding error; not gated yet)",
                                        choice("float32", "bfloat16", "int8", "int4", "fp8"))
    moments_dtype: str = setting("float32", "storage of the full-rank moments: the full-rank parameters' Adam moments "
                                 "(embedding, head, norms) in LoRDO's inner optimizer, and the whole inner optimizer's state "
                                 "for ddp, local-adam and diloco (AdamW's moments; with optim.inner = muon, Muon's momentum "
                                 "too): float32, int8 (8-bit codes with a scale per block of 256, as 8-bit Adam keeps them; "
                                 "tensors under 4,096 elements stay float32) or fp8 (e4m3 per block of 256, encoded by "
                                 "arithmetic: fast with optim.compile_codec; not gated yet)", choice("float32", "int8", "fp8"))
    lowrank_moments_dtype: str = setting("float32", "storage of the low-rank matrices' Adam moments (u and v, r per row) "
                                         "in LoRDO's inner optimizer: float32 or int8 (as moments_dtype; each matrix is then "
                                         "stepped alone, its moments expanded meanwhile; moments under 1,024 entries stay "
                                         "float32) or fp8 (as moments_dtype); Adam's form only", choice("float32", "int8", "fp8"))
    anchor_dtype: str = setting("float32", "storage of the anchor (the model at the last synchronisation, local-update "
                                "strategies): float32, bfloat16, int8 or int4 (with plain averaging the new model is "
                                "computed in float32 and the anchor's rounding never reaches it; docs/concepts.md; int4 "
                                "is not gated yet)", choice("float32", "bfloat16", "int8", "int4"))
    offload_anchor: bool = setting(False, "keep the anchor (the model at the last synchronisation) in host memory, pinned "
                                   "when a GPU is present, instead of on the training device (local-update strategies)")
    sync_buffers: bool = setting(True, "average the models' persistent buffers (BatchNorm statistics, ...) over the workers "
                                 "at each synchronisation (every step for ddp and lowrank-ddp)")
    lowrank_pattern: str = setting("auto", "which 2-D parameters are trained low-rank: auto (the block matrices: attention "
                                   "and MLP weights; not embeddings or output heads) or a regular expression on names")

    def _check(self) -> None:
        try:
            re.compile(self.lowrank_pattern)
        except re.error as exc:
            raise ConfigError(f"strategy.lowrank_pattern is not a valid regular expression: {exc}") from None


DILOCO_OUTER = (0.7, 0.9)  # DiLoCo's outer learning rate and Nesterov momentum


def outer_settings(s: StrategyConfig) -> tuple[float, float]:
    """(outer_lr, outer_momentum): as set; for ``diloco`` left at the generic defaults (1, 0: averaging),
    DiLoCo's (0.7, 0.9)."""
    if s.name == "diloco" and (s.outer_lr, s.outer_momentum) == (1.0, 0.0):
        return DILOCO_OUTER
    return s.outer_lr, s.outer_momentum



@dataclass(kw_only=True)
class SwitchConfig(Section):
    """The authors' two-phase protocol (their public launch scripts; SPEC: a warm-up phase, then a resume with
    new hyperparameters), as one run: the settings below take effect after step ``at_step``."""

    _name = "switch"
    at_step: int = setting(0, "W: the last step of the first phase; from step W + 1 the fields below hold (the authors' "
                           "protocol: 2,048, the LR warm-up's length); 0 = one phase. A multiple of strategy.sync_every "
                           "(and of switch.sync_every_before): the switch follows a synchronisation", non_negative)
    sync_every_before: int = setting(0, "K during the first phase (1: synchronise every step); 0 = strategy.sync_every",
                                     non_negative)
    omega: float = setting(-1.0, "omega from step W + 1 (lordo, lordo-local; the authors': 0.98, 0.97 at 720M); -1 = "
                           "strategy.omega", or_minus_one(unit_closed, "unchanged"))
    beta1: float = setting(-1.0, "Adam's beta1 from step W + 1 (the authors': 0.999); -1 = optim.beta1",
                           or_minus_one(unit_open, "unchanged"))
    beta2: float = setting(-1.0, "Adam's beta2 from step W + 1 (the authors': 0.999); -1 = optim.beta2",
                           or_minus_one(unit_open, "unchanged"))
    reset_moments: bool = setting(False, "zero both Adam moments and their step counter at the switch, as a freshly built "
                                  "optimizer holds them (the authors' resume); bases and error feedback stay")
    lr_scale: float = setting(1.0, "the learning rate from step W + 1 is the schedule's times this (the authors': 0.5)",
                              positive)

    @property
    def active(self) -> bool:
        return self.at_step > 0


@dataclass(kw_only=True)
class DistConfig(Section):
    _name = "dist"
    workers: int = setting(1, "M: data-parallel workers (simulated, or processes started by lordo/torchrun)", positive)
    ranks_per_worker: int = setting(1, "processes per worker (a node, a cluster: synchronous inside, gradients averaged "
                                    "every step; LoRDO between workers); torch.distributed only, M x this many processes",
                                    positive)
    backend: str = setting("auto", "sim = M workers in this process; gloo/nccl = torch.distributed; auto = torch.distributed "
                           "under torchrun (gloo on CPU, nccl on CUDA), else sim; torchft = one worker per process, started "
                           "on its own, that may fail without stopping the others (docs/multi-node.md)",
                           choice("auto", "sim", "gloo", "nccl", "torchft"))
    timeout_s: float = setting(300.0, "seconds a collective may wait for a peer before the run fails", positive)
    shard: bool = setting(False, "shard each worker's model over its ranks with FSDP2 (dist.ranks_per_worker > 1, gloo or "
                          "nccl, a local-update strategy): each rank holds and exchanges its shards; checkpoints per rank")


@dataclass(kw_only=True)
class CommConfig(Section):
    _name = "comm"
    latency_s: float = setting(1e-4, "per-collective latency of the modelled network", non_negative)
    medium: str = setting("switched", "the modelled network: switched (each worker has a link of the bandwidth to itself, "
                          "as in a cluster) or shared (one medium of the bandwidth for all workers together, as one site's "
                          "uplink or lordo bench link's throttled namespace)", choice("switched", "shared"))
    bandwidths_gbit: list = setting([1.0, 10.0], "link bandwidths (Gbit/s) between workers at which the wall-clock is modelled")
    intra_bandwidth_gbit: float = setting(100.0, "bandwidth (Gbit/s) of the link inside a worker (dist.ranks_per_worker > 1)",
                                          positive)
