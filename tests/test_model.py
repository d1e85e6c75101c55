import math

import pytest
import torch

from lordo.config import PRESETS, build_config
from lordo.errors import ConfigError
from lordo.model import GPT, GPTConfig, group_parameters
from lordo.model.params import ParamRule


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, seq_len=16, **kw))


def test_forward_shapes_and_loss():
    model = tiny()
    idx = torch.randint(0, 97, (3, 16))
    logits, loss = model(idx, torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97)
    assert loss.shape == () and math.isfinite(loss.item())
    # an untrained model is close to uniform: loss near log(vocab)
    assert abs(loss.item() - math.log(97)) < 0.5
    logits, loss = model(idx[:, :5])
    assert logits.shape == (3, 5, 97) and loss is None


def test_causal_mask_later_tokens_never_change_earlier_logits():
    model = tiny().eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = (changed[:, 9:] + 1 + torch.randint(0, 90, (2, 7))) % 97
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-6)
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3  # and the later positions do see the change


def test_sequence_longer_than_context_is_refused():
    with pytest.raises(ValueError, match="seq_len=16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def expected_params(v: int, d: int, layers: int) -> int:
    """Hand count: tied embedding, per block 4 attention d×d + 3 SwiGLU d×h + 2 norms, final norm."""
    h = 64 * math.ceil(8 * d / 3 / 64)
    return v * d + layers * (4 * d * d + 3 * d * h + 2 * d) + d


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_parameter_counts(preset):
    shape = PRESETS[preset]
    cfg = build_config(overrides=[f"model.preset={preset!r}".replace("'", '"')])
    model = GPT(GPTConfig(vocab_size=4096, d_model=cfg.model.d_model, n_layers=cfg.model.n_layers,
                          n_heads=cfg.model.n_heads, seq_len=cfg.model.seq_len))
    assert model.num_params() == expected_params(4096, shape["d_model"], shape["n_layers"])
    assert model.tok_emb.weight is not None and "lm_head" not in dict(model.named_parameters())


@pytest.mark.parametrize("shape", [dict(d_model=32, n_layers=2, n_heads=4), dict(d_model=48, n_layers=3, n_heads=2, ffn_hidden=80),
                                   dict(d_model=64, n_layers=1, n_heads=8, ffn_hidden=0)])
def test_the_count_from_the_shape_equals_the_built_models(shape):
    """GPTConfig.num_params (what the memory check uses, nothing built) against the module's own tensors."""
    cfg = GPTConfig(vocab_size=97, seq_len=16, **shape)
    assert cfg.num_params == GPT(cfg).num_params()


def test_preset_sizes_match_their_descriptions():
    sizes = {p: expected_params(4096, s["d_model"], s["n_layers"]) for p, s in PRESETS.items()}
    assert sizes["nano"] < 300_000
    assert 1_200_000 < sizes["micro"] < 1_500_000


def test_parameter_groups_cover_every_tensor_and_split_matrices():
    model = tiny()
    groups = {g.rule.group: g for g in group_parameters(model)}
    assert set(groups) == {"block_matrix", "embedding", "norm"}
    assert len(groups["block_matrix"].params) == 2 * 7  # q k v o gate up down per block
    assert all(p.ndim == 2 for p in groups["block_matrix"].params)
    assert sum(g.numel for g in groups.values()) == model.num_params()
    assert not groups["norm"].rule.weight_decay


def test_parameter_rule_coverage_is_enforced():
    model = tiny()
    with pytest.raises(ConfigError, match="matched by no parameter-group rule.*tok_emb.weight"):
        group_parameters(model, (ParamRule("only_blocks", r"^blocks\."),))
