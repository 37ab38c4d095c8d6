"""The ranks of a job compare their identities (resolved config, model source, data files, world)
through the job's store before any process group: a difference is one line, the same on every
rank, naming the key, its values and the nodes and ranks that hold each. Here the ranks are
threads of the test process around one in-process TCPStore, as torchrun's agent store serves
them (tests/app/job/test_fault_matrix_agents.py runs them as two torchrun agents)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np
import pytest
import torch.distributed as dist
from harness.synthetic_costs import cost_file

from rrfp.app.config.file_fingerprint import fingerprint, fingerprints
from rrfp.app.config.job_identity import identity
from rrfp.app.config.train_config import TrainConfig
from rrfp.app.errors import ConfigError
from rrfp.app.job.job_agreement import agree, disagreement

SETS = ["run.steps=2", "model.n_layer=2", "model.n_embd=16", "parallel.pp=2"]


def _cfg(*sets: str) -> TrainConfig:
    return TrainConfig.load("configs/gpt-tiny.toml", [*SETS, *sets], world_size=2)


def _run_ranks(identities: list[dict], wait_s: float = 30.0) -> list[object]:
    """Each rank's ``agree`` in a thread of its own, one store: what each returned or raised."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank(r: int):
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False)
        try:
            return agree(identities[r], r, len(identities), wait_s, store=store)
        except ConfigError as e:
            return e

    with concurrent.futures.ThreadPoolExecutor(len(identities)) as pool:
        return list(pool.map(rank, range(len(identities))))


def test_ranks_with_one_config_agree():
    same = identity(_cfg())
    assert _run_ranks([same, dict(same)]) == [True, True]


@pytest.mark.parametrize(
    "key, other",
    [
        ("optim.lr", "optim.lr=0.002"),
        ("run.seed", "run.seed=7"),
        ("schedule.n_microbatches", "schedule.n_microbatches=6"),
        ("checkpoint.dir", "checkpoint.dir=/tmp/elsewhere"),
        ("model.n_embd", "model.n_embd=32"),
    ],
)
def test_a_key_set_on_one_node_only_is_one_line_on_every_rank(key, other):
    ends = _run_ranks([identity(_cfg()), identity(_cfg(other))])
    assert all(isinstance(e, ConfigError) for e in ends), ends
    lines = {str(e) for e in ends}
    assert len(lines) == 1  # the same line on every rank: refuse_once prints it once
    (line,) = lines
    assert "\n" not in line
    assert f"{key}: " in line and "node 0 (" in line and "rank 0" in line and "rank 1" in line


def test_each_machines_own_keys_and_the_reports_may_differ():
    """Threads, the tokenizer cache and where rank 0 reports are each node's business."""
    mine = identity(_cfg("compute.threads=4", "output.dir=/tmp/a", "data.cache_dir=/tmp/c"))
    assert _run_ranks([identity(_cfg()), mine]) == [True, True]


def test_another_model_names_the_model_and_its_source():
    ends = _run_ranks([identity(_cfg()), identity(_cfg("run.model=llama"))])
    (line,) = {str(e) for e in ends}
    assert "run.model: " in line and '"gpt"' in line and '"llama"' in line


def test_data_files_with_other_bytes_are_named(tmp_path):
    """Two nodes naming the same path, holding other bytes: the file and both fingerprints."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(np.arange(100, dtype=np.uint16).tobytes())  # 100 tokens
    b.write_bytes(np.arange(100, dtype=np.uint16)[::-1].tobytes())
    cfg = _cfg()
    one = identity(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokens=str(a))))
    two = dict(one)
    two[f"data.tokens {a}"] = fingerprint(b)  # what the other node's file at that path holds
    (line,) = {str(e) for e in _run_ranks([one, two])}
    assert f"data.tokens {a}: 200 bytes, sha256 " in line


def test_cost_models_with_other_contents_are_named(tmp_path):
    """Ranks that plan (and choose their unsplit stages) from other costs would order the
    microbatches differently: the same path holding another model is one line."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = cost_file(tmp_path / "a", stages=2, pays=1), cost_file(tmp_path / "b", stages=2, pays=0)
    one, two = identity(_cfg(f"emulation.cost={a}")), identity(_cfg(f"emulation.cost={b}"))
    assert one["emulation.cost"] != two["emulation.cost"]
    assert identity(_cfg(f"emulation.cost={a}")) == one
    (line,) = {str(e) for e in _run_ranks([one, two])}
    assert "emulation.cost: " in line and "a cost model, sha256 " in line


def test_a_rank_that_never_posts_leaves_it_to_the_rendezvous():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert agree({"a": "1"}, 0, 2, 0.5, store=server) is False


def test_the_line_names_nodes_and_cuts_long_lists():
    posts = [
        {"node": f"node {r // 2} (h{r // 2})", "identity": {f"k{i}": str(r // 2) for i in range(6)}}
        for r in range(4)
    ]
    line = disagreement(posts)
    assert "k0: 0 (node 0 (h0): ranks 0, 1) vs 1 (node 1 (h1): ranks 2, 3)" in line
    assert "; and k4, k5 " in line  # named, without their values
    assert disagreement([posts[0], posts[1]]) is None


def test_a_large_file_is_fingerprinted_by_samples(tmp_path, monkeypatch):
    """Above FULL_BYTES the hash reads samples; a change inside one changes it, a replaced file
    of the same size too."""
    import rrfp.app.config.file_fingerprint as ff

    monkeypatch.setattr(ff, "FULL_BYTES", 1000)
    monkeypatch.setattr(ff, "EDGE_BYTES", 100)
    monkeypatch.setattr(ff, "SAMPLE_BYTES", 10)
    path = tmp_path / "big.bin"
    path.write_bytes(bytes(5000))
    first = fingerprint(path)
    assert first.startswith("5000 bytes, sampled sha256 ")
    data = bytearray(5000)
    data[4950] = 1  # in the last 100 bytes
    path.write_bytes(bytes(data))
    later = path.stat().st_mtime_ns + 10**9  # a file system's clock may not have moved yet
    os.utime(path, ns=(later, later))
    assert fingerprint(path) != first


def test_only_keys_that_name_files_are_fingerprinted(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hi")
    cfg = _cfg()
    data = dataclasses.replace(cfg.data, text=str(tmp_path / "d"), cache_dir=str(tmp_path))
    found = fingerprints({"data": data})
    assert list(found) == [f"data.text {tmp_path / 'd' / 'x.txt'}"]  # the cache is no input
