import pytest

from slidefusion.errors import UserError
from slidefusion.training.config import TrainConfig, build, load_config


def test_defaults_build_and_round_trip_through_a_dict():
    config = load_config()
    assert isinstance(config, TrainConfig)
    assert build(TrainConfig, config.to_dict()) == config


def test_yaml_preset_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: stdit-tiny\n  heads: 4\nrun:\n  steps: 7\n")
    config = load_config(path, ["optim.lr=1e-3", "run.batch_size=3", "model.attention=window",
                                "optim.max_grad_norm=null", "model.patch_size=[1,1,1]"])
    assert config.model.arch == "stdit" and config.model.heads == 4 and config.model.hidden == 32
    assert config.optim.lr == 1e-3 and isinstance(config.optim.lr, float)  # YAML reads 1e-3 as a string
    assert config.run.steps == 7 and config.run.batch_size == 3
    assert config.model.attention == "window" and config.optim.max_grad_norm is None
    assert config.model.patch_size == (1, 1, 1)


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", r"unknown config key optim.lrr; valid keys under optim: lr, betas"),
    ("nope=1", r"unknown config key nope; valid keys: model, data"),
    ("run.steps=abc", r"run.steps='abc' must be a int"),
    ("run.steps=0", r"run.steps=0 must be >= 1"),
    ("data.kind=webdataset", r"data.kind='webdataset' is unknown; valid: shapes, folder"),
    ("model.preset=huge", r"model.preset='huge' is unknown"),
    ("optim.betas=0.9", r"optim.betas=0.9 must be a list"),
    ("just-a-word", r"must look like section.key=value"),
])
def test_bad_keys_and_values_name_the_parameter(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml")):
        load_config(path)


def test_data_start_and_pooled_text_defaults_keep_the_old_behaviour():
    config = load_config(None)
    assert config.data.start == "uniform" and config.model.pooled_text is False
    config = load_config(None, ["data.start=clear", "model.pooled_text=true"])
    assert config.data.start == "clear" and config.model.pooled_text is True
    with pytest.raises(UserError, match="data.start='late' is unknown; valid: uniform, clear"):
        load_config(None, ["data.start=late"])


def test_every_float_key_is_finite_even_a_new_one():
    from dataclasses import dataclass, field

    @dataclass
    class Section:  # a section no check was written for: coercion alone refuses NaN and infinity
        scale: float = 1.0
        options: dict = field(default_factory=dict)

    assert build(Section, {"scale": "2.5"}).scale == 2.5
    for value in ("nan", float("inf"), float("-inf"), "1e400"):
        with pytest.raises(UserError, match=r"section.scale=.* must be a finite number"):
            build(Section, {"scale": value}, "section")
    with pytest.raises(UserError, match=r"section.options.a.1=nan must be a finite number"):
        build(Section, {"options": {"a": [1.0, float("nan")]}}, "section")


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", ".hidden", "-x", "a b", "x" * 201])
def test_run_names_are_plain_folder_names(name):
    with pytest.raises(UserError, match="run.name=.* must be a plain folder name"):
        load_config(None, [f"run.name='{name}'"])


def test_a_pretrained_folder_is_kept_absolute_so_the_run_works_from_any_directory(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["model.pretrained=./wan/"])
    assert config.model.pretrained == str(tmp_path / "wan")
    monkeypatch.chdir("/")  # the run's config.json, read back elsewhere, names the same folder
    again = build(TrainConfig, dataclasses.asdict(config))
    assert again.model == config.model
