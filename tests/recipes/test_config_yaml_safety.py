"""A config file runs no code: ``ConfigContainer.from_yaml`` / ``from_dict`` build only megatron_lite's
config classes and name only torch dtypes, activation and init functions. A file naming anything else
(``os.system``, ``subprocess.run``) is one ConfigError naming the key; nothing runs, and the module it
names is not even imported. Every recipe still round-trips through YAML."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron_lite.core.activations import openai_gelu
from megatron_lite.recipes import get_recipe, recipe_names
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.errors import ConfigError


def _write(tmp_path, config_dict) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_dict, sort_keys=False))
    return str(path)


@pytest.mark.parametrize(
    "where, entry",
    [
        ("train", {"_target_": "os.system", "command": "touch {marker}"}),
        ("model", {"_target_": "subprocess.run", "args": ["touch", "{marker}"]}),
        ("env_vars", {"X": {"_target_": "subprocess.run", "_call_": False}}),
        ("model.activation_func", {"_target_": "os.system", "_call_": False}),
        ("model.init_method", {"_target_": "os.system", "_partial_": True, "command": "touch {marker}"}),
    ],
)
def test_a_yaml_naming_a_function_to_run_is_refused_and_nothing_runs(tmp_path, where, entry):
    marker = tmp_path / "ran"
    text = yaml.safe_dump(entry).replace("{marker}", str(marker))
    config = ConfigContainer().to_dict()
    section, _, field = where.partition(".")
    if field:
        config[section][field] = yaml.safe_load(text)
    else:
        config[section] = yaml.safe_load(text)
    with pytest.raises(ConfigError) as err:
        ConfigContainer.from_yaml(_write(tmp_path, config))
    assert str(err.value).startswith(where) and "is not allowed" in str(err.value)
    assert not marker.exists()


def test_a_refused_target_is_not_imported(tmp_path):
    config = ConfigContainer().to_dict()
    config["logger"] = {"_target_": "antigravity.geohash", "latitude": 0}
    with pytest.raises(ConfigError, match="^logger: _target_ 'antigravity.geohash' is not allowed"):
        ConfigContainer.from_dict(config)
    assert "antigravity" not in sys.modules


def test_a_non_config_class_of_megatron_lite_is_refused(tmp_path):
    config = ConfigContainer().to_dict()
    config["train"] = {"_target_": "megatron_lite.training.launcher.Launcher", "command": ["x"], "nproc": 1}
    with pytest.raises(ConfigError, match="is not allowed"):
        ConfigContainer.from_dict(config)
    config["train"] = {"_target_": "megatron_lite.core.utils.init_method_normal", "sigma": 1.0}
    with pytest.raises(ConfigError, match="is not a config class"):
        ConfigContainer.from_dict(config)


def test_bad_yaml_and_an_unknown_field_are_one_line_naming_where(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: is not valid YAML at line 2"):
        ConfigContainer.from_yaml(str(bad))
    config = ConfigContainer().to_dict()
    config["train"]["trian_iters"] = 3
    with pytest.raises(ConfigError, match=r"^train\.trian_iters: TrainingConfig has no field"):
        ConfigContainer.from_dict(config, strict=True)


def test_functions_dtypes_and_initialisers_are_written_by_name_and_read_back(tmp_path):
    cfg = ConfigContainer()
    m = cfg.model
    m.activation_func, m.params_dtype = F.gelu, torch.bfloat16
    m.init_method = functools.partial(torch.nn.init.normal_, std=0.01)
    text = cfg.yaml_text()
    assert "torch.nn.functional.gelu" in text and "_partial_: true" in text
    back = ConfigContainer.from_yaml(_write(tmp_path, yaml.safe_load(text)))
    assert back.model.activation_func is F.gelu and back.model.params_dtype is torch.bfloat16
    assert back.model.init_method.func is torch.nn.init.normal_ and back.model.init_method.keywords == {
        "std": 0.01
    }
    # A derived initialiser is written as None and follows init_method_std again after the load.
    assert yaml.safe_load(ConfigContainer().yaml_text())["model"]["init_method"] is None
    m.activation_func = openai_gelu
    assert ConfigContainer.from_dict(cfg.to_dict()).model.activation_func is openai_gelu


@pytest.mark.parametrize("name", [n for n in recipe_names() if "h100" in n or "cpu" in n or "mixtral" in n])
def test_every_recipe_round_trips_through_yaml(tmp_path, name):
    cfg = get_recipe(name)
    if hasattr(cfg.dataset, "sequence_length"):  # core's copy of seq_length, synced by finalize()
        cfg.dataset.sequence_length = cfg.dataset.seq_length
    path = str(tmp_path / "r.yaml")
    cfg.to_yaml(path)
    assert ConfigContainer.from_yaml(path).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("value", [5, None, "x"])
def test_a_section_written_as_a_scalar_is_one_line_naming_it(value):
    config = ConfigContainer().to_dict()
    config["train"] = value
    with pytest.raises(ConfigError, match=r"^train: must be a TrainingConfig section"):
        ConfigContainer.from_dict(config)


def test_a_config_naming_a_code_loading_environment_variable_is_refused(tmp_path):
    path = tmp_path / "run_config.yaml"
    path.write_text("env_vars:\n  CUDA_INJECTION64_PATH: /tmp/x.so\n")
    config = ConfigContainer.from_yaml(str(path))  # data: read, nothing set
    with pytest.raises(ConfigError, match=r"^env_vars\.CUDA_INJECTION64_PATH: makes a process load code"):
        config.validate()
