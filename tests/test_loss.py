"""The DFlash loss op: per-slot decay exp(-(k-1)/gamma) with slot 0 masked, invalid anchors masked, chunking that
does not change the value, and a gradient made in forward equal to autograd's of the plain formula, with neither
logits tensor kept for backward."""

import math
import types

import pytest
import torch

import weakref

from dflash_graph.ops.torch_impl import _chunk_loss, loss, row_weights, slot_weights, weighted_total


def run(kind, logits, target, valid, chunk=1024, gamma=7.0):
    if valid.dim() == 1:   # an anchor's validity for every slot of its block
        valid = valid[:, None].expand(-1, logits.shape[1])
    return loss(types.SimpleNamespace(params={"kind": kind, "gamma": gamma, "chunk": chunk}), logits, target, valid)


def test_slot_weights():
    w = slot_weights(4, 2.0, "cpu")
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


@pytest.mark.parametrize("kind", ["ce", "kl", "rkl", "jsd", "tv"])
def test_chunking_does_not_change_the_loss(kind):
    torch.manual_seed(0)
    s, t = torch.randn(6, 4, 30, dtype=torch.float64), torch.randn(6, 4, 30, dtype=torch.float64)
    valid = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    a, b = run(kind, s, t, valid, chunk=1), run(kind, s, t, valid, chunk=1000)
    torch.testing.assert_close(a["loss"], b["loss"])
    torch.testing.assert_close(a["slot_acc"], b["slot_acc"])


def test_slot0_and_invalid_anchors_do_not_count():
    torch.manual_seed(0)
    s, t = torch.randn(3, 4, 20), torch.randn(3, 4, 20)
    valid = torch.tensor([True, False, True])
    base = run("kl", s, t, valid)["loss"]
    s2 = s.clone()
    s2[:, 0] += 5.0          # slot 0 holds the anchor token itself: masked
    s2[1] += 3.0             # anchor 1 is padding
    assert torch.allclose(run("kl", s2, t, valid)["loss"], base)


def test_kl_is_zero_when_the_drafter_matches():
    t = torch.randn(2, 4, 10)
    out = run("kl", t.clone(), t, torch.ones(2, dtype=torch.bool))
    assert out["loss"].abs() < 1e-6
    assert torch.all(out["slot_acc"] == 1)


@pytest.mark.parametrize("kind", ["ce", "kl", "rkl", "jsd", "tv"])
# one row per chunk (chunk 1) is the slowest gradcheck and checks what chunk 7 does: under -m slow
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 7, 0])
def test_gradient_made_in_forward_is_autograds(kind, chunk):
    """The op's kept gradient against autograd through the plain formula (every row at once), fp64; and
    gradcheck of the op itself."""
    torch.manual_seed(1)
    s = torch.randn(5, 4, 17, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 4, 17, dtype=torch.float64) * 3
    valid = torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool)[:, None].expand(5, 4).clone()
    valid[3, 2:] = False                      # a loss span that ends inside the block
    got = torch.autograd.grad(run(kind, s, t, valid, chunk=chunk)["loss"] * 1.7, s)[0]
    w = row_weights(4, 7.0, valid)
    plain = weighted_total(_chunk_loss(kind, s.reshape(20, 17), t.reshape(20, 17)).view(5, 4), w)
    want = torch.autograd.grad(plain * 1.7, s)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if kind != "tv":                          # tv's |p - q| has kinks where finite differences disagree
        assert torch.autograd.gradcheck(lambda x: run(kind, x, t, valid, chunk=chunk)["loss"], (s,))


def test_neither_logits_tensor_is_kept_for_backward():
    x = torch.randn(4, 3, 50, requires_grad=True)
    s = x * 2.0                                # the drafter's logits: a non-leaf, as lm_head makes them
    t = torch.randn(4, 3, 50)
    alive = weakref.ref(s), weakref.ref(t)
    out = run("kl", s, t, torch.ones(4, dtype=torch.bool), chunk=5)
    del s, t
    assert all(r() is None for r in alive), "the loss kept its logits for backward"
    out["loss"].backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
