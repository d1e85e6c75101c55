"""``lordo bench step``: the local optimizer step of lordo against AdamW (fused, foreach), the GaLore peers and
the two rank-r GEMMs any rank-r step needs, on one model's matrices."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..config import build_config
from ..optim.functional import takes_fused_adamw
from .timing import print_table, summarize, time_interleaved


def shape_overrides(preset: str, d_model: int | None, n_layers: int | None) -> list[str]:
    """Config overrides for a preset, optionally widened (heads of 64) and deepened."""
    overrides = [f'model.preset="{preset}"']
    if d_model:
        overrides += [f"model.d_model={d_model}", f"model.n_heads={max(1, d_model // 64)}"]
    if n_layers:
        overrides.append(f"model.n_layers={n_layers}")
    return overrides


def _model_params(preset: str, device: torch.device, d_model: int | None = None, n_layers: int | None = None):
    from ..model import build_model, group_parameters

    cfg = build_config(overrides=shape_overrides(preset, d_model, n_layers))
    model = build_model(cfg, 4096 if d_model is None else 32000).to(device)
    return model, group_parameters(model)


FLOOR = "2 rank-r GEMMs per matrix alone (floor)"
FP8_LEAN = "lordo, lean in fp8 (E, full-rank and low-rank moments in e4m3)"
COMPILED_CODEC = "lordo, lean in fp8, codec compiled (optim.compile_codec)"


def _codec_mode(step: Callable[[], Any], compiled: bool) -> Callable[[], None]:
    """``step`` with the fp8 codec compiled or eager (a process-wide switch, set before each timed step)."""
    from ..optim import float8

    def run() -> None:
        float8.use_compiled(compiled)
        step()

    return run


Replica = Callable[[], tuple[list, list[torch.Tensor], list[torch.Tensor]]]


def step_benchmark(preset: str, rank: int | None, rounds: int, device: torch.device, d_model: int | None = None,
                   n_layers: int | None = None, peers: bool = True, compiled: bool = False) -> dict[str, Any]:
    """Median time of one optimizer step on ``preset``'s parameters with fixed random gradients; ``compiled``
    adds the default step batched and compiled (``LowRankQHAdam(compile=True)``, compiled in the warm-up)."""
    model, groups = _model_params(preset, device, d_model, n_layers)
    matrices = [p for g in groups if g.rule.matrix for p in g.params]
    r = rank or min(min(p.shape) for p in matrices) // 8
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = {n: (torch.randn(p.shape, generator=gen) * 1e-3).to(device) for n, p in model.named_parameters()}

    def replica():
        """A copy of the model with the fixed gradients; returns (its groups, its matrices, the rest)."""
        from ..model import group_parameters

        m = copy.deepcopy(model)
        for n, p in m.named_parameters():
            p.grad = grads[n]
        gs = group_parameters(m)
        return gs, [p for g in gs if g.rule.matrix for p in g.params], [p for g in gs if not g.rule.matrix for p in g.params]

    skipped: dict[str, str] = {}
    optimizers = _adamw_optimizers(replica, device, skipped)
    optimizers.update(_lordo_optimizers(replica, preset, r, device, compiled))
    if peers:
        optimizers.update(_peer_optimizers(replica, r, skipped))
    fns: dict[str, Callable[[], None]] = {name: _codec_mode(opt.step, name == COMPILED_CODEC)
                                          for name, opt in optimizers.items()}
    fns[FLOOR] = _gemm_floor(replica, r, gen, device)
    times = time_interleaved(fns, rounds=rounds, warmup=3, device=device)
    reference = "AdamW fused" if "AdamW fused" in times else "AdamW foreach"
    rows = summarize(times, reference)
    n_params = sum(p.numel() for p in model.parameters())
    for row in rows:
        row["state_bytes"] = _state_bytes(optimizers[row["name"]]) if row["name"] in optimizers else None
    shape = f"{preset}" if d_model is None else f"d_model={d_model}, layers={n_layers}"
    print_table(f"optimizer step, {shape} ({n_params:,} parameters, {len(matrices)} low-rank matrices at r = {r}), "
                f"{device}, {rounds} rounds; ratio = median / {reference} median",
                rows, [("name", "optimizer", "s"), ("median_ms", "median ms", ".2f"), ("p25_ms", "p25", ".2f"),
                       ("p75_ms", "p75", ".2f"), ("ratio", f"× {reference}", ".2f"), ("state_bytes", "state bytes", ",")])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return {"preset": preset, "d_model": d_model, "n_layers": n_layers, "params": n_params, "rank": r,
            "device": str(device), "rows": rows, "skipped": skipped}


def _adamw_optimizers(replica: Replica, device: torch.device, skipped: dict[str, str]) -> dict[str, torch.optim.Optimizer]:
    """AdamW fused (the reference, where this torch has it for ``device``) and foreach, over every parameter."""
    out: dict[str, torch.optim.Optimizer] = {}
    for label, fused in (("AdamW fused", True), ("AdamW foreach", False)):
        _, ms, os_ = replica()
        if fused and not takes_fused_adamw(ms + os_):
            skipped[label] = f"torch's fused AdamW does not take these tensors ({device.type})"
            continue
        out[label] = torch.optim.AdamW(ms + os_, lr=1e-3, weight_decay=0.1, fused=fused or None,
                                       foreach=None if fused else True)
    return out


def _lordo_optimizers(replica: Replica, preset: str, r: int, device: torch.device,
                      compiled: bool) -> dict[str, torch.optim.Optimizer]:
    """lordo's optimizer as the defaults build it, its other forms of the full-rank term, its other execution
    path on ``device`` (batched over shapes, or per matrix), compiled (if asked), without error feedback, and the
    Muon rows."""
    from ..strategies import make_lowrank_optimizer

    cfg = build_config(overrides=[f'model.preset="{preset}"', f"strategy.rank={r}", 'strategy.name="lordo"'])

    def build(strategy=cfg.strategy, **options) -> torch.optim.Optimizer:
        gs, _, _ = replica()
        return make_lowrank_optimizer(gs, strategy, cfg.optim, omega=strategy.omega, **options)

    out: dict[str, torch.optim.Optimizer] = {}
    forms: dict[str, dict[str, Any]] = {  # the default full-rank term (G + E, what it applied removed from E), others
        "lordo (LowRankQHAdam)": {},
        "lordo, G + E kept": {"error_feedback_after_qh": "keep"},
        "lordo, qh_source=grad": {"qh_source": "grad"},
        "lordo, int8 E and full-rank moments": {"error_feedback_dtype": "int8", "moments_dtype": "int8"},
        "lordo, int4 E, int8 full-rank moments": {"error_feedback_dtype": "int4", "moments_dtype": "int8"},
        "lordo, lean (int8 E, full-rank and low-rank moments)": {"error_feedback_dtype": "int8", "moments_dtype": "int8",
                                                                 "lowrank_moments_dtype": "int8"},
        "lordo, lean with fp8 E": {"error_feedback_dtype": "fp8", "moments_dtype": "int8", "lowrank_moments_dtype": "int8"},
        FP8_LEAN: {"error_feedback_dtype": "fp8", "moments_dtype": "fp8", "lowrank_moments_dtype": "fp8"},
        COMPILED_CODEC: {"error_feedback_dtype": "fp8", "moments_dtype": "fp8", "lowrank_moments_dtype": "fp8"},
    }
    for label, changes in forms.items():
        out[label] = build(dataclasses.replace(cfg.strategy, **changes))
    other_path = device.type == "cpu"
    paths = {f"lordo, batched={other_path}": {"batched": other_path}}
    if compiled:
        paths["lordo, compiled"] = {"batched": True, "compile": True}
    for label, options in paths.items():
        out[label] = opt = build()
        for group in opt.param_groups:
            group.update(options)
    out["lordo, error_feedback=false"] = build(error_feedback=False)  # like for like with GaLore, which keeps none
    out.update(_muon_optimizers(replica, cfg))
    return out


def _muon_optimizers(replica: Replica, cfg) -> dict[str, torch.optim.Optimizer]:
    """Muon as ``optim.inner = "muon"`` builds it: LoRDO's r-dimensional Muon form (LowRankMuon at the same rank,
    ``optim.muon_orthogonalise = "lowrank"``) and torch's
    Muon on the block matrices with AdamW on the rest (ddp's and local-adam's inner optimizer), each with
    Newton–Schulz in bfloat16 (torch's) and in float32 (``optim.muon_ns_dtype``); then, in float32, the Muon form
    that orthogonalises the split momentum (``optim.muon_orthogonalise = "split"``, the default) and MuonAdamW with
    its state in 8 bits (``strategy.moments_dtype = "int8"``)."""
    from ..strategies import make_lowrank_optimizer
    from ..strategies.build import make_inner

    out: dict[str, torch.optim.Optimizer] = {}
    for dtype in ("bfloat16", "float32"):
        muon = dataclasses.replace(cfg.optim, inner="muon", muon_ns_dtype=dtype)
        gs, _, _ = replica()
        lowrank = dataclasses.replace(muon, muon_orthogonalise="lowrank")  # the r-dimensional form
        out[f"lordo, Muon form (LowRankMuon), NS {dtype}"] = make_lowrank_optimizer(gs, cfg.strategy, lowrank,
                                                                                   omega=cfg.strategy.omega)
        gs, _, _ = replica()
        out[f"torch Muon + AdamW (MuonAdamW), NS {dtype}"] = make_inner(gs, muon)
    muon = dataclasses.replace(cfg.optim, inner="muon", muon_ns_dtype="float32")
    gs, _, _ = replica()
    split = dataclasses.replace(muon, muon_orthogonalise="split")
    out["lordo, Muon form split, NS float32"] = make_lowrank_optimizer(gs, cfg.strategy, split, omega=cfg.strategy.omega)
    gs, _, _ = replica()
    out["torch Muon + AdamW, 8-bit state (moments_dtype int8), NS float32"] = make_inner(gs, muon, "int8")
    return out


def _peer_optimizers(replica: Replica, r: int, skipped: dict[str, str]) -> dict[str, torch.optim.Optimizer]:
    """The GaLore packages (the ``bench`` extra) at rank ``r``, their projector computed once in the warm-up."""
    out: dict[str, torch.optim.Optimizer] = {}
    huge_gap = 10**9  # the projector is computed at the first step (warm-up) and never again while timing

    def groups(projection_key: str) -> list[dict[str, Any]]:
        _, ms, os_ = replica()
        return [{"params": ms, "rank": r, "update_proj_gap": huge_gap, "scale": 1.0, projection_key: "std"},
                {"params": os_}]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from galore_torch import GaLoreAdamW
        out["galore-torch GaLoreAdamW"] = GaLoreAdamW(groups("proj_type"), lr=1e-3, weight_decay=0.1,
                                                      no_deprecation_warning=True)
    except Exception as exc:  # ImportError, or its transformers / bitsandbytes imports failing
        skipped["galore-torch GaLoreAdamW"] = f"not importable ({type(exc).__name__}: {exc}); pip install 'lordo[bench]'"
    try:
        from pytorch_optimizer import GaLore

        out["pytorch-optimizer GaLore"] = GaLore(groups("projection_type"), lr=1e-3, weight_decay=0.1)
    except Exception as exc:
        skipped["pytorch-optimizer GaLore"] = f"not importable ({type(exc).__name__}: {exc}); pip install 'lordo[bench]'"
    return out


def _gemm_floor(replica: Replica, r: int, gen: torch.Generator, device: torch.device) -> Callable[[], None]:
    """The arithmetic floor of any rank-r step: the two GEMMs per matrix that lordo's steady-state step does
    (project G, back-project the update into W), nothing else."""
    _, floor_ms, _ = replica()
    floor_bases = [torch.linalg.qr(torch.randn(min(p.shape), r, generator=gen).to(device))[0] for p in floor_ms]

    def gemms_only() -> None:
        with torch.no_grad():
            for p, b in zip(floor_ms, floor_bases):
                if p.shape[0] >= p.shape[1]:
                    p.addmm_(p.grad @ b, b.T, alpha=-1e-9)
                else:
                    p.addmm_(b, b.T @ p.grad, alpha=-1e-9)

    return gemms_only


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (after its first step)."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                total += v.numel() * v.element_size()
            elif hasattr(v, "ortho_matrix"):  # GaLore projectors hold their basis
                m = v.ortho_matrix
                tensors = m if isinstance(m, (list, tuple)) else [m]
                total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total
