from __future__ import annotations

import pytest
import torch

from torchkeel.config import build_target, load_config, parse_override, resolve_target
from torchkeel.config.schema import DataConfig, LossConfig, ModelConfig
from torchkeel.data.build import build_datasets
from torchkeel.errors import ConfigError
from torchkeel.train.build import build_loss, build_model


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_combine(tmp_path):
    path = write(tmp_path, "name: a\noptim:\n  lr: 1e-3\ntrain:\n  batch_size: 8\n")
    cfg = load_config(path, ["optim.lr=3e-4", "train.accumulate=4", "model.args.hidden=128"])
    assert cfg.name == "a"
    assert cfg.optim.lr == pytest.approx(3e-4)  # '3e-4' is a string to PyYAML; accepted for floats
    assert cfg.train.batch_size == 8 and cfg.train.accumulate == 4
    assert cfg.model.args == {"hidden": 128}


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'train.batchsize'; did you mean 'train.batch_size'"):
        load_config(write(tmp_path, "train:\n  batchsize: 8\n"))
    with pytest.raises(ConfigError, match=r"'optim.lrr'.*'optim.lr'"):
        load_config(None, ["optim.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'; known keys here: name"):
        load_config(None, ["zzz=1"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.batch_size=abc", r"train.batch_size must be an integer, got 'abc'"),
        ("train.batch_size=1.5", r"train.batch_size must be an integer"),
        ("deterministic=yes please", r"deterministic must be true or false"),
        ("optim.lr=fast", r"optim.lr must be a number, got 'fast'"),
        ("precision=bf61", r"precision must be one of fp32, bf16, fp16, got 'bf61'; did you mean 'bf16'"),
        ("model.args=3", r"model.args must be a mapping"),
        ("train=3", r"train must be a mapping"),
        ("train.batch_size=0", r"train.batch_size must be >= 1, got 0"),
        ("train.clip_grad_norm=-1", r"train.clip_grad_norm must be > 0 or null"),
        ("optim.lr=0", r"optim.lr must be > 0"),
        ("schedule.min_lr=1", r"schedule.min_lr .* is above optim.lr"),
        ("device=cpu", None),
    ],
)
def test_wrong_values_name_the_key(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_limit_is_required():
    with pytest.raises(ConfigError, match="train.max_epochs or train.max_steps"):
        load_config(None, ["train.max_epochs=null"])
    assert load_config(None, ["train.max_epochs=null", "train.max_steps=5"]).train.max_steps == 5


def test_fp16_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device; use precision=bf16"):
        load_config(None, ["device=cpu", "precision=fp16"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*missing.yaml' not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"line 2: invalid YAML"):
        load_config(write(tmp_path, "name: a\n  bad: [\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_override_syntax():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=null") == ("a", None)
    with pytest.raises(ConfigError, match="must look like key=value"):
        parse_override("optim.lr")
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        load_config(None, ["name=a", "name.x=1"])
    with pytest.raises(ConfigError, match=r"name must be a string, got \{'x': 1\}"):
        load_config(None, ["name.x=1"])


def test_import_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.target='torch.nn.Linear' must be an import path 'module:callable'"):
        resolve_target("torch.nn.Linear", "model.target")
    with pytest.raises(ConfigError, match=r"model.target='no_such_mod:f': cannot import module 'no_such_mod'"):
        resolve_target("no_such_mod:f", "model.target")
    with pytest.raises(ConfigError, match=r"module 'torch.nn' has no attribute 'Linearr'"):
        resolve_target("torch.nn:Linearr", "model.target")
    with pytest.raises(
        ConfigError, match=r"model.args.in_featurez is not an argument of torch.nn:Linear; did you mean 'in_features'"
    ):
        build_target("torch.nn:Linear", {"in_featurez": 2, "out_features": 2}, "model")
    with pytest.raises(
        ConfigError, match=r"model.args do not fit torch.nn:Linear.*missing a required argument: 'out_features'"
    ):
        build_target("torch.nn:Linear", {"in_features": 2}, "model")


def test_callables_that_return_the_wrong_thing():
    with pytest.raises(
        ConfigError, match=r"model.target='builtins:dict' returned dict; it must return a torch.nn.Module"
    ):
        build_model(ModelConfig(target="builtins:dict"))
    with pytest.raises(ConfigError, match=r"data.target='builtins:dict' returned dict; it must return a pair"):
        build_datasets(DataConfig(target="builtins:dict"))
    with pytest.raises(ConfigError, match=r"returned a train dataset of type int"):
        build_datasets(DataConfig(target="test_config:_ints"))
    with pytest.raises(ConfigError, match=r"loss.target='builtins:int' returned int"):
        build_loss(LossConfig(target="builtins:int"))
    assert isinstance(
        build_model(ModelConfig(target="torch.nn:Linear", args={"in_features": 2, "out_features": 3})), torch.nn.Linear
    )


def _ints():
    return 1, 2
