"""Parameter groups by rule: a name pattern plus a number of dimensions decides each tensor's group.

Every parameter must match a rule (the first match wins), so a new module never slips through
unnoticed. The same rules decide, in later stages, which matrices are trained low-rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
