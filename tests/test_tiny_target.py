"""The tiny Qwen3.5 target shipped in graphs/tiny/ and the torch helpers around it.

Measured when the assets were made (tools/train_tiny_target.py, seed 0, bf16 weights
evaluated in fp32): held-out loss 0.703 nats/token over all 50 held-out documents and
0.835 over the 20 this test uses, against log(768) = 6.64 for a uniform guess (and
6.67 before training). The test asserts < 1.5.
"""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch

from dflash_graph.models.nn.target import (
    body_forward,
    build_target,
    document_spans,
    embedding,
    final_norm,
    lm_head,
    load_tokenizer,
)

TINY = Path(__file__).resolve().parents[1] / "graphs" / "tiny"
HOLDOUT = 50  # the last 50 corpus documents are never trained on (tools/train_tiny_target.py --holdout)
HELD_OUT_BOUND = 1.5  # nats/token; log(768) = 6.64


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_target(TINY, TINY, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def held_out() -> list[str]:
    lines = (TINY / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines[-HOLDOUT:]]


def encode(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text) + [tok.eos_token_id])


def packed(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat(docs), torch.cat([torch.arange(len(d)) for d in docs])


def test_assets_load_offline(model, tok):
    cfg = json.loads((TINY / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    assert {"linear_attention", "full_attention"} == set(cfg["layer_types"])
    assert cfg["tie_word_embeddings"] is False
    assert model.config.vocab_size == len(tok) == cfg["vocab_size"]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg["eos_token_id"] == cfg["pad_token_id"]
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id is not None
    assert (TINY / "model.safetensors").stat().st_size < 5 * 2**20
    assert (TINY / "corpus.jsonl").stat().st_size < 1_100_000
    # the raw file also loads with both libraries directly
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"))
    text = "Once upon a time, there was a small red fox named Mia. 3 plus 4 is 7."
    assert raw.encode(text).ids == fast.encode(text) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
    # a .safetensors file works as well as the directory, and the weights are the trained ones
    again = build_target(TINY / "config.json", TINY / "model.safetensors", torch.float32, "cpu")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_multimodal_checkpoint_layout_is_mapped(tmp_path):
    """A Qwen3.5 release is a Qwen3_5ForConditionalGeneration checkpoint: a composite
    config with a text_config, text weights under model.language_model., plus vision
    and multi-token-prediction weights that a causal LM does not have."""
    from safetensors.torch import load_file, save_file

    text_cfg = json.loads((TINY / "config.json").read_text())
    composite = {"model_type": "qwen3_5", "text_config": text_cfg, "tie_word_embeddings": False}
    state = load_file(str(TINY / "model.safetensors"))
    remapped = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in state.items()}
    remapped["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    remapped["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(remapped, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(composite))
    m = build_target(tmp_path, tmp_path, torch.float32, "cpu")
    ref = build_target(TINY, TINY, torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), ref.state_dict().values(), strict=True))
    # and a checkpoint that does not fit the config is refused, not half-loaded
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        build_target(TINY, tmp_path / "partial.safetensors", torch.float32, "cpu")


def test_random_init_is_seeded_and_dtype_respected():
    torch.manual_seed(3)
    a = build_target(TINY, None, torch.bfloat16, "cpu")
    torch.manual_seed(3)
    b = build_target(json.loads((TINY / "config.json").read_text()), None, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_held_out_loss_far_below_uniform(model, tok, held_out):
    docs = [encode(tok, t) for t in held_out[:20]]
    ids, pos = packed(docs)
    with torch.no_grad():
        last, _ = body_forward(model, ids, pos, capture=[])
        logits = lm_head(model)(final_norm(model)(last)).float()
    # next-token loss inside each document (the last position of a document predicts nothing)
    starts = torch.tensor([s for s, _ in document_spans(pos)][1:] + [len(ids)])
    keep = torch.ones(len(ids) - 1, dtype=torch.bool)
    keep[starts[:-1] - 1] = False
    loss = torch.nn.functional.cross_entropy(logits[:-1][keep], ids[1:][keep])
    print(f"held-out loss {loss:.4f} nats/token over {int(keep.sum())} tokens, log V = {math.log(len(tok)):.4f}")
    assert loss < HELD_OUT_BOUND < math.log(len(tok)) / 4


def test_body_forward_matches_causal_lm_logits_per_document(model, tok, held_out):
    docs = [encode(tok, t)[:n] for t, n in zip(held_out[:3], (70, 1, 45), strict=True)]
    ids, pos = packed(docs)
    with torch.no_grad():
        last, captured = body_forward(model, ids, pos, capture=[1, 3])
        logits = lm_head(model)(final_norm(model)(last))
        ref = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    assert last.shape == (len(ids), model.config.hidden_size)
    assert set(captured) == {1, 3} and all(v.shape == last.shape for v in captured.values())
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    assert embedding(model) is model.model.embed_tokens


def test_capture_ids_are_decoder_layer_outputs(model, tok, held_out):
    doc = encode(tok, held_out[3])[:90]
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        last, captured = body_forward(model, doc, torch.arange(len(doc)), capture=range(n_layers))
        hs = model(input_ids=doc[None], output_hidden_states=True, use_cache=False).hidden_states
    assert len(hs) == n_layers + 1
    for i in range(n_layers - 1):
        torch.testing.assert_close(captured[i], hs[i + 1][0], rtol=0, atol=0)
    # transformers replaces its last entry with the final-normed state; layer id L-1 is pre-norm
    assert torch.equal(last, captured[n_layers - 1])
    torch.testing.assert_close(final_norm(model)(last), hs[n_layers][0], rtol=0, atol=0)
    assert not torch.allclose(last, hs[n_layers][0])


def test_documents_are_isolated(model, tok, held_out):
    d1 = encode(tok, held_out[4])[:60]
    d1_other = encode(tok, held_out[5])[:75]  # different tokens and a different length
    d2 = encode(tok, held_out[6])[:80]
    with torch.no_grad():
        last_a, cap_a = body_forward(model, *packed([d1, d2]), capture=[0, 2, 4])
        last_b, cap_b = body_forward(model, *packed([d1_other, d2]), capture=[0, 2, 4])
        alone, cap_alone = body_forward(model, d2, torch.arange(len(d2)), capture=[0, 2, 4])
    torch.testing.assert_close(last_a[len(d1) :], last_b[len(d1_other) :], rtol=0, atol=0)
    torch.testing.assert_close(last_a[len(d1) :], alone, rtol=0, atol=0)
    for i in (0, 2, 4):
        torch.testing.assert_close(cap_a[i][len(d1) :], cap_b[i][len(d1_other) :], rtol=0, atol=0)
        torch.testing.assert_close(cap_a[i][len(d1) :], cap_alone[i], rtol=0, atol=0)

    # Why documents run one by one: in ONE packed row, transformers isolates the
    # full-attention layers (block mask from position ids) but not Gated DeltaNet,
    # whose state flows from document 1 into document 2. If this ever stops leaking,
    # a faster packed path becomes possible.
    ids, pos = packed([d1, d2])
    with torch.no_grad():
        row = model.model(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state[0]
    assert not torch.allclose(row[len(d1) :], final_norm(model)(alone), atol=1e-3)


def test_hooks_removed_even_on_error(model):
    layers = model.model.layers
    before = [len(layer._forward_hooks) for layer in layers]
    bad_ids = torch.tensor([3, 5, model.config.vocab_size + 7])  # out of the embedding's range
    with pytest.raises(IndexError):
        body_forward(model, bad_ids, torch.arange(3), capture=[0, 1])
    assert [len(layer._forward_hooks) for layer in layers] == before
    with pytest.raises(ValueError):
        body_forward(model, bad_ids[:2], torch.arange(2), capture=[model.config.num_hidden_layers])


def test_document_spans():
    assert document_spans(torch.tensor([0, 1, 2, 0, 1, 0])) == [(0, 3), (3, 5), (5, 6)]
    assert document_spans(torch.tensor([4, 5, 0, 1])) == [(0, 2), (2, 4)]  # a continued first document
    assert document_spans(torch.tensor([], dtype=torch.long)) == []
