"""A config saved with a UTF-8 byte order mark (as some Windows editors write it) reads as the
same config; bytes that are not UTF-8 stay one line naming the byte."""

from __future__ import annotations

import pytest
from harness import ROOT

from rrfp.app.config.train_config import TrainConfig, read_config
from rrfp.app.errors import ConfigError

CONFIG = ROOT / "configs" / "gpt-tiny.toml"


def test_a_config_with_a_utf8_bom_is_the_same_config(tmp_path):
    marked = tmp_path / "bom.toml"
    marked.write_bytes(b"\xef\xbb\xbf" + CONFIG.read_bytes())
    assert read_config(marked) == read_config(CONFIG)
    assert TrainConfig.load(marked, [], world_size=4) == TrainConfig.load(CONFIG, [], world_size=4)


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    latin = tmp_path / "latin1.toml"
    latin.write_bytes(b"# caf\xe9\n" + CONFIG.read_bytes())
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 5: b'\\xe9'\)"):
        read_config(latin)
