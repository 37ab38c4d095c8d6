"""A HF run's model is checked before any process group: a safetensors checkpoint that is cut
short, not safetensors, missing a shard or a tensor, or of another config is one line naming the
file (ConfigError: exit 2), and so are values that would give NaN (``rope_theta = 0``); an int
where the HF config wants a float (``rms_norm_eps = 1``) is that float."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import ROOT

pytest.importorskip("transformers", reason="the rrfp[hf] extra (make installs it)")

from harness.cli_run import rrfp_in_process  # noqa: E402
from harness.launch import rank_vars  # noqa: E402

from rrfp.app.config.train_config import TrainConfig  # noqa: E402
from rrfp.app.errors import ConfigError  # noqa: E402

CONFIG = ROOT / "configs" / "hf-llama-tiny.toml"


def _load(*overrides: str) -> TrainConfig:
    return TrainConfig.load(CONFIG, list(overrides), world_size=4)


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> dict:
    """The whole model's tensors, as configs/hf-llama-tiny.toml builds it."""
    import rrfp

    model = rrfp.build_hf_model(_load().model.hf(), seed=0)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def _save(state: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file(state, str(path))
    return path


def _refused(checkpoint: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(f"model.checkpoint='{checkpoint}'")
    line = str(caught.value)
    assert line.startswith(f"model.checkpoint {checkpoint}: ") and "\n" not in line, line
    return line


def test_a_whole_checkpoint_passes(state, tmp_path):
    good = _save(state, tmp_path / "model.safetensors")
    assert _load(f"model.checkpoint='{good}'").model.checkpoint == str(good)
    assert _load(f"model.checkpoint='{tmp_path}'").model.checkpoint == str(tmp_path)


def test_a_file_cut_short_or_not_safetensors_is_named(state, tmp_path):
    data = _save(state, tmp_path / "whole.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    assert f"cannot read safetensors file {cut}: " in _refused(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    assert f"cannot read safetensors file {junk}: " in _refused(junk)


def test_a_sharded_checkpoint_missing_a_shard_or_an_index_is_named(state, tmp_path):
    keys = sorted(state)
    half = len(keys) // 2
    shards = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    for name, names in shards.items():
        _save({k: state[k] for k in names}, folder / name)
    index = {"weight_map": {k: name for name, names in shards.items() for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _load(f"model.checkpoint='{folder}'").model.checkpoint == str(folder)
    (folder / "b.safetensors").unlink()
    assert f"{folder / 'b.safetensors'}, the file it names for {keys[half]}, does not exist" in (
        _refused(folder)
    )
    (folder / "model.safetensors.index.json").unlink()
    assert "holds neither model.safetensors.index.json nor model.safetensors" in _refused(folder)


def test_a_missing_tensor_or_another_configs_shape_is_named(state, tmp_path):
    lost = "model.layers.3.mlp.up_proj.weight"
    part = _save({k: v for k, v in state.items() if k != lost}, tmp_path / "part.safetensors")
    assert f"{part} has no tensor {lost}" in _refused(part)
    other = dict(state, **{lost: state[lost][:, :32].contiguous()})
    wrong = _save(other, tmp_path / "other.safetensors")
    line = _refused(wrong)
    assert f"{lost} has shape (128, 32), the model's {lost} (128, 64)" in line, line


def test_the_command_refuses_a_broken_checkpoint_before_any_process_group(tmp_path):
    """Rank 0 of 2 whose rendezvous nobody serves: exit 2 with one line, so before any group."""
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    res = rrfp_in_process(
        "train",
        "--config",
        str(CONFIG),
        "--set",
        f"model.checkpoint='{junk}'",
        "--set",
        f"log_dir={tmp_path / 'logs'}",
        env=rank_vars(0, 2, port=9),
    )
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rrfp: error: "), res.stderr
    assert f"model.checkpoint {junk}: cannot read safetensors file" in lines[0], lines


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
def test_a_value_that_gives_nan_is_refused(key):
    with pytest.raises(ConfigError, match=f"HFConfig.{key} must be a positive number, got 0"):
        _load(f"model.{key}=0")


def test_an_int_where_the_hf_config_wants_a_float_is_that_float(tmp_path):
    """transformers' configs refuse an int for a float field; TOML writes ``1`` for one."""
    toml = tmp_path / "hf.toml"
    toml.write_text(CONFIG.read_text().replace("[model]\n", "[model]\nrms_norm_eps = 1\n"))
    cfg = TrainConfig.load(toml, [], world_size=4)
    assert cfg.model.rms_norm_eps == 1.0 and isinstance(cfg.model.rms_norm_eps, float)
    assert cfg.model.hf().rms_norm_eps == 1.0
