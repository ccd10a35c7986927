"""The DFlash loss op: per-slot decay exp(-(k-1)/gamma) with slot 0 masked, invalid anchors masked, chunking that
does not change the value, and a closed-form backward equal to autograd's."""

import math
import types

import pytest
import torch

from dflash_graph.ops.torch_impl import _ChunkDivergence, _chunk_loss, loss, slot_weights


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


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_closed_form_backward(kind):
    torch.manual_seed(1)
    s = torch.randn(5, 17, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 17, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: _ChunkDivergence.apply(x, t, kind), (s,))
    g = torch.randn(5, dtype=torch.float64)
    a = torch.autograd.grad((_ChunkDivergence.apply(s, t, kind) * g).sum(), s)[0]
    b = torch.autograd.grad((_chunk_loss(kind, s, t) * g).sum(), s)[0]
    torch.testing.assert_close(a, b)
