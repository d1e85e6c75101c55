import pytest

from lordo.config import (
    DEFAULT_LR,
    STRATEGY_NAMES,
    Config,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    StrategyConfig,
    TrainConfig,
    build_config,
    describe,
    parse_override,
)
from lordo.errors import ConfigError


def test_defaults_and_preset_fill_shape():
    cfg = build_config(overrides=["model.preset=nano"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.seq_len) == (32, 2, 64)
    # an explicit shape key beats the preset
    cfg = build_config(overrides=["model.preset=nano", "model.d_model=48"])
    assert cfg.model.d_model == 48 and cfg.model.n_layers == 2


def test_toml_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[optim]\nlr = 1e-3\n[train]\nsteps = 100\n[schedule]\nkind = "wsd"\n')
    cfg = build_config(f, ["optim.lr=2e-3"])
    assert cfg.optim.lr == 2e-3 and cfg.train.steps == 100 and cfg.schedule.kind == "wsd"


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", r"optim.lr must be >= 0, got -1.0"),
        ("model.preset=huge", r"model.preset must be one of 'nano', 'micro', 'small', 'paper-16m', got 'huge'"),
        ("optim.learning_rate=1", r"unknown config key optim.'learning_rate'; keys of \[optim\] are: lr, beta1"),
        ("trainer.steps=3", r"unknown config section 'trainer'; sections are: model, data"),
        ("train.steps=ten", r"train.steps must be an integer, got 'ten'"),
        ("train.steps=2.5", r"train.steps must be an integer, got 2.5"),
        ("optim.beta2=1.0", r"optim.beta2 must be in \[0, 1\), got 1.0"),
        ("schedule.kind=linear", r"schedule.kind must be one of 'cosine', 'wsd', 'constant', got 'linear'"),
        ("model.n_heads=3", r"model.d_model \(128\) must be divisible by model.n_heads \(3\)"),
        ("train.compile=yes", r"train.compile must be true or false, got 'yes'"),
        ("lr", r"--set expects section.key=value"),
        ("optim.lr=nan", r"optim.lr must be a finite number"),
    ],
)
def test_bad_values_name_the_field_and_allowed_values(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=[override])


def test_bad_toml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("lr = 1\n")
    with pytest.raises(ConfigError, match="top-level key 'lr' must be a \\[section\\]"):
        build_config(flat)


def test_override_values_are_parsed_as_toml():
    assert parse_override("optim.lr=3e-3") == ("optim", "lr", 3e-3)
    assert parse_override("train.compile=true") == ("train", "compile", True)
    assert parse_override("data.dir=/tmp/x y") == ("data", "dir", "/tmp/x y")


def test_describe_lists_every_key():
    text = describe()
    assert "optim.lr = 0.0  -- peak learning rate; 0 = the strategy's default" in text
    assert "schedule.kind" in text and "one of: cosine, wsd, constant" in text


def test_default_lr_is_the_strategys_tuned_one_and_an_explicit_lr_wins():
    from lordo.config import DEFAULT_LR

    assert build_config(overrides=['strategy.name="ddp"']).optim.lr == 3e-3
    assert build_config(overrides=['strategy.name="lordo"']).optim.lr == 3e-3
    assert build_config(overrides=['strategy.name="lordo-global-noqh"']).optim.lr == 6e-3
    assert build_config(overrides=['strategy.name="lordo"', "optim.lr=1e-3"]).optim.lr == 1e-3
    assert set(DEFAULT_LR) == set(STRATEGY_NAMES)
    with pytest.raises(ConfigError, match="optim.lr must be >= 0"):
        build_config(overrides=["optim.lr=-1"])


def test_omega_left_at_minus_one_takes_its_forms_value_and_follows_a_change():
    """strategy.omega = -1 (the default): 0.95 for lordo with the split Muon form (MUON_OMEGA), the paper's 0.98 for
    Adam's form, the other Muon forms and lordo-local; resolved again when the form changes after building; a value
    set by hand stays; config.json holds the resolved number."""
    from lordo.config import validate

    muon = ['optim.inner="muon"']
    assert build_config().strategy.omega == 0.98
    assert build_config(overrides=muon).strategy.omega == 0.95
    assert build_config(overrides=[*muon, 'optim.muon_orthogonalise="lowrank"']).strategy.omega == 0.98
    assert build_config(overrides=[*muon, 'strategy.name="lordo-local"']).strategy.omega == 0.98
    assert build_config(overrides=[*muon, "strategy.omega=0.98"]).strategy.omega == 0.98
    cfg = build_config(overrides=muon)
    assert cfg.to_dict()["strategy"]["omega"] == 0.95
    cfg.optim.inner = "auto"
    validate(cfg)
    assert cfg.strategy.omega == 0.98
    cfg.strategy.omega = 0.9
    cfg.optim.inner = "muon"
    validate(cfg)
    assert cfg.strategy.omega == 0.9
    with pytest.raises(ConfigError, match=r"strategy.omega must be in \[0, 1\] \(or -1: automatic\), got 1.5"):
        build_config(overrides=["strategy.omega=1.5"])


def test_the_strategys_default_lr_follows_a_strategy_changed_after_building():
    """optim.lr = 0 resolved for lordo (3e-3) is resolved again when the strategy changes and the config is
    validated again (it kept 0.003 for lordo-global-noqh, whose fresh build gives 6e-3); a rate set by hand
    stays; config.json holds the sections' fields only."""
    from dataclasses import asdict

    from lordo.config import validate

    cfg = build_config(overrides=['strategy.name="lordo"'])
    cfg.strategy.name = "lordo-global-noqh"
    validate(cfg)
    assert cfg.optim.lr == DEFAULT_LR["lordo-global-noqh"] == 6e-3
    cfg.optim.lr = 1e-3
    cfg.strategy.name = "ddp"
    validate(cfg)
    assert cfg.optim.lr == 1e-3
    assert set(asdict(cfg)) == {"model", "data", "optim", "schedule", "train", "strategy", "dist", "comm", "switch"}


@pytest.mark.parametrize("make, message", [
    (lambda: StrategyConfig(rank=-5), r"strategy.rank must be > 0, got -5"),
    (lambda: StrategyConfig(name="nonsense"), r"strategy.name must be one of 'ddp', .*got 'nonsense'"),
    (lambda: OptimConfig(lr="fast"), r"optim.lr must be a number, got 'fast'"),
    (lambda: ModelConfig(d_model=30, n_heads=4), r"model.d_model \(30\) must be divisible by model.n_heads \(4\)"),
    (lambda: Config(schedule=ScheduleConfig(warmup_steps=100), train=TrainConfig(steps=10)),
     r"schedule.warmup_steps \(100\) must be smaller than train.steps \(10\)"),
])
def test_configs_are_checked_when_constructed(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_default_config_trains_at_its_strategys_learning_rate():
    assert Config().strategy.name == "lordo" and Config().optim.lr == DEFAULT_LR["lordo"]
    assert Config(strategy=StrategyConfig(name="ddp")).optim.lr == DEFAULT_LR["ddp"]
    assert OptimConfig(lr=3).lr == 3.0 and isinstance(OptimConfig(lr=3).lr, float)  # coerced like a config file's


@pytest.mark.parametrize("overrides, message", [
    (["dist.shard=true"], r"dist.shard = true shards each worker's model over its ranks: set dist.ranks_per_worker >= 2"),
    (["dist.shard=true", "dist.ranks_per_worker=2", 'dist.backend="sim"'], r"runs under torch.distributed .* not 'sim'"),
    (["dist.shard=true", "dist.ranks_per_worker=2", 'strategy.name="ddp"'], r"local-update strategies .* not 'ddp'"),
    (["dist.shard=true", "dist.ranks_per_worker=2", "train.compile=true"], r"does not take train.compile"),
    (["dist.shard=true", "dist.ranks_per_worker=2", "optim.compile_step=true"], r"optim.compile_step = true would not apply"),
])
def test_sharded_workers_refuse_what_they_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(overrides=overrides)
    build_config(overrides=["dist.shard=true", "dist.ranks_per_worker=2"])  # what it runs with


def test_set_wins_over_the_flags_and_a_replaced_value_is_checked_too(capsys):
    """docs/cli.md's order: defaults < --model < --config < the other flags < --set; a value that a later one
    replaces is still checked (red team W3: `--steps 2 --set train.steps=-5` ran)."""
    from lordo.cli import main

    for argv in (["--steps", "2", "--set", "train.steps=-5"], ["--steps", "-5", "--set", "train.steps=2"]):
        assert main(["train", *argv, "--out", "/nonexistent/never"]) == 2
        assert "train.steps must be > 0, got -5" in capsys.readouterr().err
    cfg = build_config(overrides=["train.steps=7", "train.steps=9"])
    assert cfg.train.steps == 9
