"""The MoE layer (router, grouped experts, aux loss, statistics, bias update) against a naive
per-token reference computed with plain autograd in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from rrfp.nn.grouped_experts import GroupedExperts, grouped_mm_fits
from rrfp.nn.moe_aux_loss import aux_loss_scale, collect_aux_losses
from rrfp.nn.moe_layer import MoELayer, moe_layers
from rrfp.nn.split_linear import WeightGradQueue, collect_weight_grads

D, H, E = 8, 16, 4


def _layer(**kw) -> MoELayer:
    torch.manual_seed(0)
    args = dict(dim=D, hidden_dim=H, num_experts=E, top_k=2) | kw
    return MoELayer(**args).double()


def _naive(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: its top-k experts' SwiGLU outputs weighted by its gates."""
    r, ex = layer.router, layer.experts
    h = x.reshape(-1, x.shape[-1])
    logits = h @ r.gate.weight.t()
    scores = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
    choose = scores + (r.expert_bias if hasattr(r, "expert_bias") else 0)
    rows = []
    for t in range(h.shape[0]):
        ids = choose[t].detach().topk(layer.top_k).indices
        g = scores[t, ids]
        if r.norm_topk:
            g = g / g.sum()
        y = 0
        for gate, e in zip(g, ids.tolist()):
            y = y + gate * (ex.w2[e] @ (F.silu(ex.w1[e] @ h[t]) * (ex.w3[e] @ h[t])))
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(h[t])
        rows.append(y)
    return torch.stack(rows).view(x.shape)


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 12])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_layer_equals_per_token_reference(score_func, shared, norm_topk):
    layer = _layer(score_func=score_func, shared_hidden_dim=shared, norm_topk=norm_topk)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    g = torch.randn_like(x)
    layer(x).backward(g)
    mine = _grads(layer)
    layer.zero_grad()
    _naive(layer, x).backward(g)
    ref = _grads(layer)
    assert mine.keys() == ref.keys() and "router.gate.weight" in mine
    for n in ref:
        torch.testing.assert_close(mine[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-10, atol=1e-12)


def test_grouped_mm_equals_the_loop():
    """float32 takes torch._grouped_mm on CPU; float64 loops: same values, same gradients,
    including an expert that gets no rows."""
    torch.manual_seed(1)
    ex = GroupedExperts(3, D, H)
    x = torch.randn(9, D)
    counts = torch.tensor([4, 0, 5])
    assert grouped_mm_fits(x, ex.w1) and not grouped_mm_fits(x.double(), ex.w1.double())
    g = torch.randn(9, D)
    xf = x.clone().requires_grad_()
    ex(xf, counts).backward(g)
    f32 = {n: p.grad.clone() for n, p in ex.named_parameters()}
    ex64 = GroupedExperts(3, D, H).double()
    ex64.load_state_dict({n: p.double() for n, p in ex.state_dict().items()})
    xd = x.double().requires_grad_()
    ex64(xd, counts).backward(g.double())
    for n, p in ex64.named_parameters():
        torch.testing.assert_close(f32[n], p.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xf.grad, xd.grad.float(), rtol=1e-4, atol=1e-5)
    assert ex64.w1.grad[1].abs().max() == 0


def test_expert_weight_grads_wait_for_w():
    """Under an active queue (the split backward's "layers" mode) backward leaves the experts'
    and the router's weight gradients to the queue; running it gives the whole backward's."""
    layer = _layer(shared_hidden_dim=12, aux_loss_coeff=0.1)
    x = torch.randn(2, 5, D, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    whole, whole_x = _grads(layer), x.grad.clone()
    layer.zero_grad()
    x.grad = None
    queue = WeightGradQueue()
    with collect_weight_grads(queue):
        y = layer(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, whole_x, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in layer.parameters())
    assert len(queue) == 3 + 1 + 3  # three grouped products, the gate, three shared linears
    queue.run()
    for n, gr in whole.items():
        torch.testing.assert_close(layer.get_parameter(n).grad, gr, rtol=1e-12, atol=1e-14)


def test_aux_loss_value_and_injected_gradient():
    """The injected gradient at scale 1/M equals the gradient of (loss + coeff * aux) / M with
    the aux loss added to the loss by hand."""
    coeff, m = 0.3, 4
    layer = _layer(aux_loss_coeff=coeff)
    x = torch.randn(3, 4, D, dtype=torch.float64)
    with collect_aux_losses() as auxes:
        out = layer(x)
    (aux,) = auxes
    _, ids, probs = layer.router(x.view(-1, D))
    counts = torch.bincount(ids.view(-1), minlength=E).double()
    t = x.shape[0] * x.shape[1]
    expected = coeff * E * ((counts / (2 * t)) * probs.mean(0)).sum()
    torch.testing.assert_close(aux, expected, rtol=1e-12, atol=0)
    ((out.square().sum() + aux) / m).backward()
    by_hand = _grads(layer)
    layer.zero_grad()
    with aux_loss_scale(1 / m):
        out = layer(x)
    (out.square().sum() / m).backward()
    injected = _grads(layer)
    for n in by_hand:
        torch.testing.assert_close(injected[n], by_hand[n], rtol=1e-12, atol=1e-15, msg=n)
    layer.zero_grad()
    layer(x).square().sum().div(m).backward()  # without the aux term the router's grad differs
    assert not torch.allclose(layer.router.gate.weight.grad, by_hand["router.gate.weight"])


def test_statistics_count_training_forwards_once():
    layer = _layer(aux_loss_coeff=0.1)
    x = torch.randn(2, 3, D, dtype=torch.float64, requires_grad=True)
    layer(x).sum().backward()
    with set_checkpoint_early_stop(False):  # the recomputation runs the whole forward again
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    with torch.no_grad():
        layer(x)  # evaluation
    step = layer.take_step()
    assert step.microbatches == 2 and step.dropped == 0
    assert int(step.tokens_per_expert.sum()) == 2 * 6 * 2
    assert step.aux_loss > 0
    assert layer.take_step().microbatches == 0  # cleared


def test_counts_per_forward_only_when_recorded():
    """A routing record asks for each training forward's counts; nobody else keeps them, so a
    loop that never takes its steps holds nothing that grows."""
    layer = _layer()
    x = torch.randn(2, 3, D, dtype=torch.float64)
    layer(x).sum().backward()
    assert layer.take_step().per_forward == []
    layer.record_counts = True
    for n in (2, 5):
        layer(torch.randn(1, n, D, dtype=torch.float64)).sum().backward()
    with torch.no_grad():
        layer(x)  # evaluation: not counted
    step = layer.take_step()
    assert [int(c.sum()) for c in step.per_forward] == [2 * 2, 5 * 2]
    assert torch.equal(sum(step.per_forward), step.tokens_per_expert)
    assert layer.take_step().per_forward == []


def test_bias_moves_against_the_load_and_only_chooses():
    layer = _layer(bias_update_rate=0.5)
    assert "router.expert_bias" in layer.state_dict()  # saved and resumed with the model
    layer.update_bias(torch.tensor([10, 2, 4, 0]))
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.5]  # at the mean: stays
    x = torch.randn(2, 5, D, dtype=torch.float64)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    gates, ids, _ = layer.router(x.view(-1, D))
    assert (ids == 3).any(dim=-1).all()  # the bias forces expert 3 in
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-10, atol=1e-12)
    assert _layer().state_dict().keys().isdisjoint({"router.expert_bias"})


def test_moe_layers_finds_them_in_order():
    a, b = _layer(), _layer()
    assert moe_layers([torch.nn.Sequential(a), torch.nn.ModuleList([b])]) == [a, b]


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(top_k=5), "top_k"),
        (dict(score_func="relu"), "score_func"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
        (dict(bias_update_rate=-1.0), "bias_update_rate"),
        (dict(hidden_dim=0), "hidden_dim"),
    ],
)
def test_bad_settings_say_which(kw, words):
    with pytest.raises(ValueError, match=words):
        _layer(**kw)
