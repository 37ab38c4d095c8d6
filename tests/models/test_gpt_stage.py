import random

import pytest
import torch

from rrfp.core.tasks import Kind, Task
from rrfp.models.data import DataConfig, batches, corpus
from rrfp.models.gpt import GPT, GPTConfig, loss_fn, make_stage, split_layers, tied
from rrfp.nn.split_linear import SplitLinear
from rrfp.pipeline.worker import StageWorker

CFG = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=32)
DATA = DataConfig(seed=3, microbatch_size=2, min_seq_len=8, max_seq_len=24, corpus_bytes=1 << 20)
M = 4


def _model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return GPT(cfg).double()


# -- model and split ---------------------------------------------------------


def test_config_validates():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)


def test_split_layers():
    assert split_layers(4, 1) == [range(0, 4)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    for n, s in [(7, 3), (12, 5)]:
        r = split_layers(n, s)
        assert [i for x in r for i in x] == list(range(n))
        assert max(map(len, r)) - min(map(len, r)) <= 1
    for bad in (0, 5):
        with pytest.raises(ValueError, match="num_stages"):
            split_layers(4, bad)


def test_init_is_deterministic():
    a, b = _model(), _model()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.lm_head.weight, _model(seed=1).lm_head.weight)


@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_stages_chain_to_full_model(S):
    model = _model()
    stages = [make_stage(model, s, S) for s in range(S)]
    for T in (5, 17, 64):
        idx = torch.randint(0, 256, (2, T))
        x = idx
        for st in stages:
            x = st(x)
        assert x.shape == (2, T, 256)
        assert torch.equal(x, model(idx))


@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_stage_params_partition_model(S):
    model = _model()
    full = dict(model.named_parameters())
    names = [set(dict(make_stage(model, s, S).named_parameters())) for s in range(S)]
    assert sum(map(len, names)) == len(full)
    assert set().union(*names) == set(full)
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[-1]
    if S == 4:
        assert names[2] == {n for n in full if n.startswith("transformer.h.2.")}


@pytest.mark.parametrize("stages", [(0, 3), (1, 2), (0, 2)])
def test_a_ranks_virtual_stages_are_pieces_of_one_model(stages):
    """Workload.build_stages: each of a rank's stages is built from the seed, so that, whichever
    stages a rank holds (v: 0 and 3 of 4; interleaved: 0 and 2), they are the one model's pieces."""
    from rrfp.models.gpt import workload

    full = dict(_model(seed=5).named_parameters())
    modules = workload.build_stages(CFG, stages, 4, seed=5)
    for s, m in zip(stages, modules):
        params = dict(m.double().named_parameters())
        assert params.keys() == set(dict(make_stage(_model(seed=5), s, 4).named_parameters()))
        for n, p in params.items():
            assert torch.equal(p, full[n]), (s, n)


def test_stage_is_a_copy():
    model = _model()
    st = make_stage(model, 0, 2)
    assert st.transformer.wte.weight is not model.transformer.wte.weight
    assert torch.equal(st.transformer.wte.weight, model.transformer.wte.weight)


def test_split_linears_in_model():
    m = _model()
    assert isinstance(m.lm_head, SplitLinear)
    blk = m.transformer.h[0]
    for lin in (blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc, blk.mlp.c_proj):
        assert isinstance(lin, SplitLinear)


def test_tied_embeddings():
    cfg = GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=32, tie_embeddings=True)
    model = _model(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    st = make_stage(model, 0, 1)
    assert st.lm_head.weight is st.transformer.wte.weight
    first, last = (
        make_stage(model, 0, 2),
        make_stage(model, 1, 2),
    )  # under PP: one copy each, declared
    assert torch.equal(first.transformer.wte.weight, last.lm_head.weight)
    assert tied(cfg, 0, 2) == {"embedding": "transformer.wte.weight"}
    assert tied(cfg, 1, 2) == {"embedding": "lm_head.weight"}
    assert tied(cfg, 0, 1) == {} and tied(GPTConfig(), 0, 2) == {}


def test_too_long_sequence_rejected():
    with pytest.raises(ValueError, match="block_size"):
        _model()(torch.zeros(1, 65, dtype=torch.long))


# -- pipelined run against the single-process reference ------------------------


def _reference(data):
    model = _model()
    loss = sum(loss_fn(model(i), t) for i, t in data) / len(data)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _gpipe(s, S, split):
    order = [Task(Kind.F, m) for m in range(M)] + [Task(Kind.B, m) for m in range(M)]
    return order + ([Task(Kind.W, m) for m in range(M)] if split else [])


def _one_f_one_b(s, S, split):
    warm = min(S - s - 1, M)
    order = [Task(Kind.F, m) for m in range(warm)]
    for m in range(M - warm):
        order += [Task(Kind.F, warm + m), Task(Kind.B, m)]
    order += [Task(Kind.B, m) for m in range(M - warm, M)]
    return order + ([Task(Kind.W, m) for m in range(M)] if split else [])


def _zb_eager_w(s, S, split):
    """1F1B with W right after each B, and B in reverse microbatch order at the end."""
    order = []
    for t in _one_f_one_b(s, S, False):
        order.append(t)
        if split and t.kind is Kind.B:
            order.append(Task(Kind.W, t.mb))
    return order


class _Pipe:
    """All stages in one process; 'messages' are dict entries."""

    def __init__(self, S, split, data):
        model = _model()
        self.S, self.data = S, data
        self.workers = [
            StageWorker(make_stage(model, s, S), s, S, M, loss_fn, split) for s in range(S)
        ]
        self.acts, self.grads, self.done = {}, {}, set()

    def ready(self, s, t):
        if t.kind is Kind.F:
            return s == 0 or (s - 1, t.mb) in self.acts
        if t.kind is Kind.B:
            return (s, Task(Kind.F, t.mb)) in self.done and (
                s == self.S - 1 or (s + 1, t.mb) in self.grads
            )
        return (s, Task(Kind.B, t.mb)) in self.done

    def run(self, s, t):
        w, m = self.workers[s], t.mb
        if t.kind is Kind.F:
            x = self.data[m][0] if s == 0 else self.acts.pop((s - 1, m))
            out = w.forward(m, x, self.data[m][1] if s == self.S - 1 else None)
            if s < self.S - 1:
                self.acts[(s, m)] = out
        elif t.kind is Kind.B:
            g = w.backward(m, None if s == self.S - 1 else self.grads.pop((s + 1, m)))
            if s > 0:
                self.grads[(s, m)] = g
        else:
            w.weight(m)
        self.done.add((s, t))

    def run_orders(self, orders):
        pos = [0] * self.S
        while any(pos[s] < len(orders[s]) for s in range(self.S)):
            progressed = False
            for s in range(self.S):
                if pos[s] < len(orders[s]) and self.ready(s, orders[s][pos[s]]):
                    self.run(s, orders[s][pos[s]])
                    pos[s] += 1
                    progressed = True
            assert progressed, f"deadlock at {pos}"

    def run_random(self, split, seed):
        rng = random.Random(seed)
        todo = {
            (s, Task(k, m))
            for s in range(self.S)
            for m in range(M)
            for k in ((Kind.F, Kind.B, Kind.W) if split else (Kind.F, Kind.B))
        }
        while todo:
            s, t = rng.choice(sorted(x for x in todo if self.ready(*x)))
            self.run(s, t)
            todo.remove((s, t))

    def result(self):
        last = self.workers[-1]
        loss = sum(last.losses.values()) / M
        grads = {}
        for w in self.workers:
            assert w.inflight == ()
            grads.update({n: p.grad for n, p in w.module.named_parameters()})
        return loss, grads


@pytest.fixture(scope="module")
def data():
    return batches(DATA, step=0, n_microbatches=M)


@pytest.fixture(scope="module")
def reference(data):
    return _reference(data)


def _check(pipe, reference):
    ref_loss, ref_grads = reference
    loss, grads = pipe.result()
    assert abs(loss - ref_loss) < 1e-10
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        assert g is not None, n
        torch.testing.assert_close(g, ref_grads[n], rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    "order", [_gpipe, _one_f_one_b, _zb_eager_w], ids=["gpipe", "1f1b", "zb_eager_w"]
)
def test_pipeline_matches_reference(S, split, order, data, reference):
    pipe = _Pipe(S, split, data)
    pipe.run_orders([order(s, S, split) for s in range(S)])
    _check(pipe, reference)


@pytest.mark.parametrize("S", [2, 4])
@pytest.mark.parametrize("split", [False, True])
def test_pipeline_random_ready_order(S, split, data, reference):
    pipe = _Pipe(S, split, data)
    pipe.run_random(split, seed=S * 10 + split)
    _check(pipe, reference)


def test_weight_grads_wait_for_w(data):
    S = 2
    pipe = _Pipe(S, True, data)
    pipe.run_orders([[t for t in _gpipe(s, S, True) if t.kind is not Kind.W] for s in range(S)])
    for w in pipe.workers:
        assert w.inflight == tuple(range(M))
        # every weight gradient waits for W: split-aware layers queue theirs, autograd defers the
        # rest (embeddings, layer norms) to capture points
        assert all(p.grad is None for p in w.module.parameters()), [
            n for n, p in w.module.named_parameters() if p.grad is not None
        ]
        assert w.activation_bytes(0) > 0
    pipe.workers[1].weight(2)
    assert pipe.workers[1].inflight == (0, 1, 3)
    assert pipe.workers[1].activation_bytes(2) == 0


def test_misuse_errors(data):
    idx, tgt = data[0]
    model = _model()
    first = StageWorker(make_stage(model, 0, 2), 0, 2, M, loss_fn, split=False)
    last = StageWorker(make_stage(model, 1, 2), 1, 2, M, loss_fn, split=True)
    with pytest.raises(RuntimeError, match="stage 0: B1 before F1"):
        first.backward(1, torch.zeros(1))
    h = first.forward(1, idx)
    with pytest.raises(RuntimeError, match="stage 0: F1 twice"):
        first.forward(1, idx)
    with pytest.raises(RuntimeError, match="stage 0: W1 .*not split"):
        first.weight(1)
    with pytest.raises(RuntimeError, match="stage 1: F1 on the last stage needs targets"):
        last.forward(1, h)
    with pytest.raises(RuntimeError, match="stage 1: F7 out of range"):
        last.forward(7, h, tgt)
    last.forward(1, h, tgt)
    with pytest.raises(RuntimeError, match="stage 1: W1 before B1"):
        last.weight(1)
    with pytest.raises(RuntimeError, match="stage 0: B1 grad_output shape"):
        first.backward(1, torch.zeros(3))
    with pytest.raises(RuntimeError, match="stage 1: reset with microbatches in flight"):
        last.reset()
    g = last.backward(1)
    assert g.shape == h.shape
    assert first.backward(1, g) is None
    last.weight(1)
    with pytest.raises(RuntimeError, match="stage 1: W1 twice"):
        last.weight(1)
    last.reset()
    assert last.losses == {} and last.inflight == ()


# -- data ----------------------------------------------------------------------


def test_data_batches():
    a = batches(DATA, 5, 6)
    b = batches(DATA, 5, 6)
    assert len(a) == 6
    lens = set()
    for (ia, ta), (ib, tb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(ta, tb)
        assert ia.dtype == torch.int64 and ia.shape == ta.shape
        assert ia.shape[0] == DATA.microbatch_size
        assert DATA.min_seq_len <= ia.shape[1] <= DATA.max_seq_len
        assert torch.equal(ia[:, 1:], ta[:, :-1])
        assert 0 <= int(ia.min()) and int(ia.max()) < 256
        lens.add(ia.shape[1])
    assert len(lens) > 1
    # microbatch m does not depend on how many are drawn; other steps/seeds differ
    assert torch.equal(batches(DATA, 5, 2)[1][0], a[1][0])
    assert not torch.equal(batches(DATA, 6, 1)[0][0], a[0][0])
    other = DataConfig(
        seed=4, microbatch_size=2, min_seq_len=8, max_seq_len=24, corpus_bytes=1 << 20
    )
    assert not torch.equal(batches(other, 5, 1)[0][0], a[0][0])


def test_corpus_is_python_source():
    data = corpus(DATA.corpus_bytes)
    assert data.dtype == torch.uint8 and data.numel() == DATA.corpus_bytes
    text = bytes(data[:200_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_data_config_validates():
    with pytest.raises(ValueError, match="min_seq_len"):
        DataConfig(min_seq_len=10, max_seq_len=5)
    with pytest.raises(ValueError, match="microbatch_size"):
        DataConfig(microbatch_size=0)
