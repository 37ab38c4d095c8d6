"""``loaded_class``: the class when its module is imported, else ``()``, which no object is an
instance of; it never imports the module itself."""

import collections
import sys
import types

from rrfp.comm.loaded_class import DTENSOR, FSDP_MODULE, PIPELINE_STAGE, loaded_class


def test_a_loaded_module_gives_its_class():
    assert loaded_class(("collections", "OrderedDict")) is collections.OrderedDict
    assert isinstance(collections.OrderedDict(), loaded_class(("collections", "OrderedDict")))


def test_a_module_not_imported_gives_no_class_and_stays_unimported():
    name = "rrfp_test_never_imported"
    assert loaded_class((name, "Anything")) == ()
    assert not isinstance(object(), loaded_class((name, "Anything")))
    assert name not in sys.modules


def test_a_module_still_importing_without_the_class_gives_no_class(monkeypatch):
    monkeypatch.setitem(sys.modules, "rrfp_test_half", types.ModuleType("rrfp_test_half"))
    assert loaded_class(("rrfp_test_half", "NotYetDefined")) == ()


def test_the_torch_classes_it_names_are_where_it_looks():
    """Importing the modules here: each (module, name) is a class torch defines there."""
    import torch.distributed.fsdp
    import torch.distributed.pipelining.stage
    import torch.distributed.tensor

    assert loaded_class(DTENSOR) is torch.distributed.tensor.DTensor
    assert loaded_class(FSDP_MODULE) is torch.distributed.fsdp.FSDPModule
    assert loaded_class(PIPELINE_STAGE) is torch.distributed.pipelining.stage._PipelineStageBase
