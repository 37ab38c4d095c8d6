"""The torchtitan switch as torchtitan's ConfigManager reads it: ``--module rrfp.titan`` gives
torchtitan's config of the same name with rrfp's pipelining function and keys, validated when
parsed; and the two things ``pipeline_ready`` changes in what it is handed (the chunked loss is
refused, FSDP at data-parallel degree 1 is left out). In process, no ranks."""

from __future__ import annotations

import functools
import re
import types

import pytest
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import ConfigManager
from torchtitan.distributed.pipeline_parallel import pipeline_llm

from rrfp.titan import ReadyParallelism, ReadyTrainerConfig, pipeline_ready
from rrfp.titan.pipelining import _fsdp_left_out

BASE = ["--config", "llama3_debugmodel", "--training.disable_cuda_graphs"]


def _shown(config) -> str:
    """A config as its repr, without addresses: its inits are functions made per call."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(config))


def parse(module: str, *args: str):
    return ConfigManager().parse_args(["--module", module, *BASE, *args])


def test_module_path_gives_torchtitans_config_with_rrfps_schedule_and_keys():
    ready = parse(
        "rrfp.titan",
        *("--parallelism.pipeline_parallel_degree", "2", "--parallelism.rrfp_hint", "zbh1"),
        *("--parallelism.rrfp_budget", "3", "--parallelism.rrfp_dispatch", "fixed"),
        *("--parallelism.rrfp_weight_split", "autograd"),
    )
    titan = parse("llama3", "--parallelism.pipeline_parallel_degree", "2")
    assert isinstance(ready, ReadyTrainerConfig) and isinstance(ready.parallelism, ReadyParallelism)
    p = ready.parallelism
    assert (p.rrfp_hint, p.rrfp_budget, p.rrfp_dispatch) == ("zbh1", "3", "fixed")
    assert p.rrfp_weight_split == "autograd" and ReadyParallelism().rrfp_weight_split == "auto"
    assert p.pipeline_parallel_degree == 2
    fn = ready.model_spec.pipelining_fn
    assert isinstance(fn, functools.partial) and fn.func is pipeline_ready
    assert fn.keywords == {"pipelining_fn": pipeline_llm}
    # torchtitan's model and everything else as torchtitan's own config has them
    assert _shown(ready.model_spec.model) == _shown(titan.model_spec.model)
    assert ready.model_spec.parallelize_fn is titan.model_spec.parallelize_fn
    assert ready.training == titan.training and ready.optimizer == titan.optimizer
    assert (ready.model_spec.name, ready.model_spec.flavor) == ("llama3", "debugmodel")
    # the chunked loss gives way to the loss it wraps; torchtitan's own config keeps it
    assert isinstance(titan.loss, ChunkedLossWrapper.Config)
    assert isinstance(ready.loss, CrossEntropyLoss.Config) and ready.loss == titan.loss.loss_fn
    assert titan.model_spec.pipelining_fn is pipeline_llm
    # rrfp's defaults
    assert (parse("rrfp.titan").parallelism.rrfp_hint, ReadyParallelism().rrfp_budget) == (
        "bfw",
        "2x",
    )


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("rrfp_hint", "zzz", "parallelism.rrfp_hint: unknown hint 'zzz'"),
        ("rrfp_dispatch", "eager", "parallelism.rrfp_dispatch:"),
        ("rrfp_budget", "lots", "parallelism.rrfp_budget:"),
        ("rrfp_weight_split", "layers", "parallelism.rrfp_weight_split:"),
    ],
)
def test_a_bad_rrfp_key_is_one_error_naming_it_and_exit_2(key, value, says, capsys):
    with pytest.raises(SystemExit) as exited:
        parse("rrfp.titan", f"--parallelism.{key}", value)
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert says in err, err


def test_a_name_torchtitan_lacks_is_named():
    with pytest.raises(ValueError, match="'llama3_nosuch' not found in rrfp.titan.config_registry"):
        ConfigManager().parse_args(["--module", "rrfp.titan", "--config", "llama3_nosuch"])


def test_the_chunked_loss_is_refused_in_one_line():
    loss = ChunkedLossWrapper.Config().build()
    with pytest.raises(NotImplementedError, match="^rrfp.titan: the chunked loss"):
        pipeline_ready(
            None, parallel_dims=None, parallelism=None, parallelize_fn=None, loss_fn=loss
        )


def apply_fsdp_to_decoder(model, *args, **kwargs):
    """Stands in for torchtitan's: the fake parallelize function below calls it by this name."""
    model.wrapped = True


def parallelize(model, **kwargs):
    apply_fsdp_to_decoder(model)
    model.parallelized = True
    return model


@pytest.mark.parametrize("dp, cp, wrapped", [(1, 1, False), (2, 1, True), (1, 2, True)])
def test_fsdp_is_left_out_only_where_nothing_is_data_parallel(dp, cp, wrapped):
    dims = types.SimpleNamespace(dp_enabled=dp > 1, cp_enabled=cp > 1)
    training = types.SimpleNamespace(dtype="float32", mixed_precision_param="float32")
    model = types.SimpleNamespace(wrapped=False, parallelized=False)
    _fsdp_left_out(parallelize, dims)(model, training=training)
    assert model.parallelized and model.wrapped is wrapped
    assert globals()["apply_fsdp_to_decoder"] is apply_fsdp_to_decoder  # put back after
