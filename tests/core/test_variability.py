import numpy as np
import pytest

from rrfp.core.tasks import Kind
from rrfp.core.variability import PRESETS, Variability, uniform


@pytest.mark.parametrize("preset", PRESETS)
def test_deterministic_and_order_free(preset):
    v = Variability.preset(preset)
    grid = v.duration(7, 3, np.arange(4)[:, None], np.arange(16)[None, :], Kind.F)
    for s, m in [(0, 0), (3, 15), (2, 5)]:
        assert v.duration(7, 3, s, m, Kind.F) == pytest.approx(
            float(np.broadcast_to(grid, (4, 16))[s, m])
        )
    assert v.duration(7, 3, 1, 1, Kind.B) == v.duration(7, 3, 1, 1, Kind.B)
    assert v.duration(8, 3, 1, 1, Kind.B) != v.duration(7, 3, 1, 1, Kind.B) or preset == "none"


def test_one_valued_numpy_keys_draw_the_bits_of_python_ints_and_of_array_elements():
    """A numpy integer or a 0-d integer array (one stage through ``np.asarray``) draws on the
    integers' path, bit for bit the draw of the Python int and of its element in an array."""
    for k in (0, 7, -3, 2**63 + 5):
        dtype = np.uint64 if k >= 2**63 else np.int64
        element = uniform(np.asarray([k], dtype=dtype), 3, 1)[0]
        for key in (k, dtype(k), np.asarray(k, dtype=dtype)):
            assert uniform(key, 3, 1) == element, (k, key)
            assert uniform(2, key) == uniform(np.asarray([2]), np.asarray([k], dtype=dtype))[0]
    v = Variability.preset("lang")
    assert v.duration(5, 1, np.asarray(2), np.int64(3), Kind.W) == v.duration(5, 1, 2, 3, Kind.W)


def test_unsplit_backward_is_b_plus_w():
    v = Variability.preset("lang")
    b, w = v.duration(1, 0, 2, 3, Kind.B, True), v.duration(1, 0, 2, 3, Kind.W, True)
    assert v.duration(1, 0, 2, 3, Kind.B, False) == pytest.approx(b + w)


def test_preset_statistics():
    m = np.arange(20000)
    none = Variability.preset("none")
    assert none.duration(0, 0, 0, 5, Kind.F) == 1.0 and none.latency(0, 0, 0, 5, Kind.F) == 0.05
    jit = Variability.preset("jitter").duration(0, 0, 1, m, Kind.F)
    assert abs(np.log(jit).std() - 0.3) < 0.01 and abs(jit.mean() - 1) < 0.02
    lang = Variability.preset("lang")
    # the length factor is shared by every task of a microbatch, across stages
    r = lang.duration(0, 0, 0, m, Kind.F) / lang.duration(0, 0, 5, m, Kind.F)
    assert (
        np.corrcoef(
            np.log(lang.duration(0, 0, 0, m, Kind.F)), np.log(lang.duration(0, 0, 5, m, Kind.F))
        )[0, 1]
        > 0.7
    )
    assert np.mean(r > 2.5) > 0.03  # stragglers x3 show up
    mm = Variability.preset("mm")
    v0 = mm.duration(0, 0, 0, m, Kind.F) / (0.2 + 0.8 / 3 * mm.images(0, 0, m))
    assert set(np.unique(mm.images(0, 0, m))) == {0, 1, 2, 4, 8}
    assert abs(np.log(v0).std() - 0.2) < 0.01  # only jitter left on the vision stage
    slow = Variability.preset("none", slow_stage=2, slow_factor=3.0)
    assert slow.duration(0, 0, 2, 0, Kind.F) == 3.0 and slow.duration(0, 0, 1, 0, Kind.F) == 1.0


def test_bad_variability():
    with pytest.raises(ValueError, match="unknown variability preset"):
        Variability.preset("huge")
    with pytest.raises(ValueError, match="straggler_p"):
        Variability.preset("lang", straggler_p=2.0)
