"""Parameter groups by rule: a name pattern plus a number of dimensions decides each tensor's group.

Every parameter must match a rule (the first match wins), so a new module never slips through
unnoticed. The same rules decide, in later stages, which matrices are trained low-rank.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class ParamRule:
    group: str
    pattern: str  # regular expression matched (re.search) against the parameter's qualified name
    ndim: int | None = None  # None: any number of dimensions
    weight_decay: bool = True
    matrix: bool = False  # a 2-D block weight: the candidates for low-rank treatment

    def matches(self, name: str, ndim: int) -> bool:
        return (self.ndim is None or self.ndim == ndim) and re.search(self.pattern, name) is not None


DEFAULT_RULES: tuple[ParamRule, ...] = (
    ParamRule("block_matrix", r"^blocks\.\d+\.(attn|mlp)\.\w+\.weight$", ndim=2, matrix=True),
    ParamRule("embedding", r"^tok_emb\.weight$", ndim=2),
    ParamRule("norm", r"norm\.weight$", ndim=1, weight_decay=False),
)


@dataclass
class ParamGroup:
    rule: ParamRule
    names: list[str]
    params: list[nn.Parameter]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def group_parameters(model: nn.Module, rules: tuple[ParamRule, ...] = DEFAULT_RULES) -> list[ParamGroup]:
    """Assign each trainable parameter to the first rule it matches; raise if one matches none."""
    groups = {r.group: ParamGroup(r, [], []) for r in rules}
    unmatched = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        rule = next((r for r in rules if r.matches(name, p.ndim)), None)
        if rule is None:
            unmatched.append(f"{name} {tuple(p.shape)}")
            continue
        groups[rule.group].names.append(name)
        groups[rule.group].params.append(p)
    if unmatched:
        raise ConfigError(
            "parameters matched by no parameter-group rule: "
            + ", ".join(unmatched)
            + "; rules are: "
            + ", ".join(f"{r.group}={r.pattern!r}/ndim={r.ndim}" for r in rules)
        )
    return [g for g in groups.values() if g.params]


def format_groups(groups: list[ParamGroup]) -> str:
    total = sum(g.numel for g in groups)
    rows = [("group", "tensors", "params", "share", "decay", "example")]
    for g in groups:
        rows.append(
            (
                g.rule.group,
                str(len(g.params)),
                f"{g.numel:,}",
                f"{100 * g.numel / total:.1f}%",
                "yes" if g.rule.weight_decay else "no",
                g.names[0],
            )
        )
    rows.append(("total", str(sum(len(g.params) for g in groups)), f"{total:,}", "100.0%", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# Groups for any model (the library API): decided by module type, not by names.
MATRIX_RULE = ParamRule("block_matrix", "", ndim=2, matrix=True)
EMBEDDING_RULE = ParamRule("embedding", "", ndim=2)
OTHER_MATRIX_RULE = ParamRule("other_matrix", "")
VECTOR_RULE = ParamRule("norm_bias", "", ndim=1, weight_decay=False)


def group_by_module(model: nn.Module) -> list[ParamGroup]:
    """Parameter groups of an arbitrary model, by the module that owns each parameter.

    - ``block_matrix`` (low-rank candidates): weights of ``nn.Linear`` layers, except output heads, and the
      packed input projection of ``nn.MultiheadAttention``;
    - ``embedding`` (full rank): ``nn.Embedding`` weights, and ``nn.Linear`` weights that widen the input to
      as many outputs as an embedding has entries (an untied output head over the vocabulary);
    - ``other_matrix`` (full rank, weight decay): any other parameter of two or more dimensions;
    - ``norm_bias`` (full rank, no weight decay): one-dimensional parameters (norm scales, biases).

    Tied parameters appear once, under their first name (``named_parameters`` order)."""
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    groups = {r.group: ParamGroup(r, [], []) for r in (MATRIX_RULE, EMBEDDING_RULE, OTHER_MATRIX_RULE, VECTOR_RULE)}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        module = owner[id(p)]
        if p.ndim < 2:
            group = "norm_bias"
        elif isinstance(module, nn.Embedding):
            group = "embedding"
        elif isinstance(module, nn.MultiheadAttention) and p is module.in_proj_weight:
            group = "block_matrix"
        elif isinstance(module, nn.Linear) and p is module.weight:
            head = module.out_features in vocab_sizes and module.out_features > module.in_features
            group = "embedding" if head else "block_matrix"
        else:
            group = "other_matrix"
        groups[group].names.append(name)
        groups[group].params.append(p)
    return [g for g in groups.values() if g.params]


def param_groups(model: nn.Module, rank: int, target_modules: Sequence[str] | str | None = None,
                 update_proj_gap: int | None = 200, **options: Any) -> list[dict[str, Any]]:
    """Parameter groups for :class:`~lordo.optim.LowRankQHAdam` used on its own, as GaLore and Hugging Face
    users build them: ``[{"params": low-rank matrices, "rank": rank, **options}, {"params": the rest,
    "rank": None}]``.

    ``target_modules``: which matrices train low-rank, as Hugging Face's ``optim_target_modules``: a list of
    substrings of parameter names (``["attn", "mlp"]``) or one regular expression; None (default): the rule
    ``lordo.distributed`` uses (``nn.Linear`` weights, not output heads over the vocabulary, not embeddings).
    Only 2-D parameters can be low-rank; ``update_proj_gap`` (default 200, GaLore's: each basis recomputed from
    the gradient every 200 steps of its matrix; None: kept until you call ``refresh_basis``) and ``options``
    (``scale``, ``omega``, ...) apply to the low-rank group."""
    if target_modules is None:
        chosen = {id(p) for g in group_by_module(model) if g.rule.group == "block_matrix" for p in g.params}
        heads = [f"{name}.weight" for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and m.weight.requires_grad and id(m.weight) not in chosen]
        if heads:  # a Linear as wide as the vocabulary is taken for the output head: say so, it may be a block's
            warnings.warn(f"param_groups: {', '.join(heads)} left full-rank: as wide as an embedding's vocabulary, "
                          "taken for an output head; name the matrices with target_modules= to choose yourself",
                          UserWarning, stacklevel=2)
    else:
        if isinstance(target_modules, str):
            try:
                pattern = re.compile(target_modules)
            except re.error as exc:
                raise ValueError(f"target_modules is not a valid regular expression: {exc}") from None
            match = lambda name: pattern.search(name) is not None  # noqa: E731
        else:
            names = list(target_modules)
            match = lambda name: any(t in name for t in names)  # noqa: E731
        chosen = {id(p) for n, p in model.named_parameters() if p.ndim == 2 and match(n)}
    low = [p for p in model.parameters() if p.requires_grad and id(p) in chosen]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    if not low:
        raise ValueError(f"target_modules {target_modules!r} matches no 2-D parameter of the model")
    groups = [{"params": low, "rank": rank, "update_proj_gap": update_proj_gap, **options}]
    if rest:
        groups.append({"params": rest, "rank": None})
    return groups
