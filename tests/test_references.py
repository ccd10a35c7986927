"""The objective presets against the references' own code (docs/drafter.md, "The objective"): one case, the same
drafter weights, inputs and anchors (2 packed documents), at block 4 and 16, run through the project's drafter and
loss (and its fused head + loss) beside vllm-project/speculators' DFlashDraftModel.forward (preset "speculators")
and SpecForge's OnlineDFlashModel.forward (preset "specforge"), each with its anchor selection bypassed (SpecForge
also with the project's per-document mask and positions: its trainer has no packed documents). Forward logits within
1e-6 (relative to the largest logit), loss and gradients within 1e-5 relative, fp32.

The packages are the `references` extra, installed without their dependency sets (.ci/run):
`pip install --no-deps speculators==0.9.0 specforge==0.2.0 openai sniffio hs-connectors==0.9.0`."""

import types

import pytest
import torch
from torch import nn

from dflash_graph.models.dflash import DFlashDims
from dflash_graph.models.nn.dflash import DFlashDrafter, RMSNorm, dflash_attention_mask, slot_valid
from dflash_graph.ops import torch_impl
from dflash_graph.train.export import export_name

H, V, T, LAYERS = 64, 96, 56, (1, 3)
DOCS = (30, 26)
ANCHORS = {4: (1, 6, 13, 20, 31, 38, 45, 50), 16: (2, 9, 31, 36)}   # every block inside its document


def _dims(block: int) -> DFlashDims:
    return DFlashDims(hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=block,
                      mask_token_id=1, target_layer_ids=LAYERS, target_hidden_size=H, vocab_size=V)


def _case(block: int):
    """The shared case: a drafter with its own norm (weights perturbed off their init), the target's embedding,
    verifier norm and lm_head, context features, the verifier's last hidden state, ids, positions, anchors."""
    torch.manual_seed(0)
    d = _dims(block)
    embed = nn.Embedding(V, H)
    drafter = DFlashDrafter(d, embed, own_norm=True)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    head = nn.Linear(H, V, bias=False)
    vnorm = RMSNorm(H, 1e-6, torch.float32)
    with torch.no_grad():
        head.weight.normal_(0, 0.3)
        vnorm.weight.add_(0.1 * torch.randn(H))
    pos = torch.cat([torch.arange(n) for n in DOCS])
    ids = torch.randint(2, V, (T,))
    loss_mask = torch.ones(T, dtype=torch.bool)
    loss_mask[0] = loss_mask[DOCS[0]] = False          # a document's first token is not a loss token
    loss_mask[DOCS[0] - 8: DOCS[0] - 5] = False        # and a span inside the first
    anchors = torch.tensor(ANCHORS[block])
    return types.SimpleNamespace(
        d=d, block=block, embed=embed, drafter=drafter, head=head, vnorm=vnorm, pos=pos, ids=ids,
        loss_mask=loss_mask, anchors=anchors, valid=slot_valid(loss_mask, anchors, len(anchors), block),
        context=torch.randn(T, len(LAYERS) * H), last=torch.randn(T, H))


def _ours(case, preset: str, fused: bool):
    """The project's forward, logits and loss under `preset`, and the gradients of the drafter's parameters."""
    drafter, b = case.drafter, case.block
    drafter.zero_grad(set_to_none=True)
    hidden = drafter(case.context, case.ids, case.pos, case.anchors)           # [A, B, H], before the norm
    x = drafter.norm(hidden)
    index = case.anchors[:, None] + torch.arange(b)                             # [A, B]
    params = {"objective": preset, "chunk": 8}
    c = types.SimpleNamespace(params=params, module=lambda name: case.head)
    inputs = {"valid": case.valid}
    if preset == "specforge":
        inputs["labels"] = case.ids[index]
    else:
        with torch.no_grad():
            tx = case.vnorm(case.last[(index - 1) % T])
        inputs["target_x" if fused else "target"] = tx if fused else case.head(tx)
    logits = case.head(x)
    out = torch_impl.fused_head_loss(c, x, **inputs) if fused else torch_impl.loss(c, logits, **inputs)
    out["loss"].backward()
    grads = {export_name(k): p.grad.clone() for k, p in drafter.named_parameters()}
    return logits.detach().reshape(-1, V), out["loss"].detach(), grads


def _load(ref: nn.Module, case) -> None:
    sd = {export_name(k): v for k, v in case.drafter.state_dict().items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if k.split(".")[0] in ("layers", "fc", "hidden_norm", "norm")], missing


def _layer_config(**extra):
    """The drafter's layers as a Qwen3Config, the same for both references (and the project's DFlashDims)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=512, **extra)


def _speculators(case):
    core = pytest.importorskip("speculators.models.dflash.core",
                               reason="speculators not installed (the `references` extra, .ci/run)")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    # pydantic >= 2.14 leaves the config "not fully defined" after the first model made from it: the annotations
    # name `torch`, which its module imports only under TYPE_CHECKING; rebuild with torch in the namespace
    DFlashSpeculatorConfig.model_rebuild(force=True, _types_namespace={"torch": torch})
    b = case.block
    tl = _layer_config()
    tl._attn_implementation = "eager"     # its dense float mask (create_float_mask) from its own mask_mod
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=V, block_size=b, aux_hidden_state_layer_ids=list(LAYERS),
        mask_token_id=1, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=b - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                      architectures=["Qwen3ForCausalLM"])))
    ref = core.DFlashDraftModel(cfg)
    _load(ref, case)
    with torch.no_grad():
        ref.embed_tokens.weight.copy_(case.embed.weight)
        ref.lm_head.weight.copy_(case.head.weight)
        ref.verifier_lm_head.weight.copy_(case.head.weight)
        ref.verifier_norm.weight.copy_(case.vnorm.weight)
    ref.lm_head.weight.requires_grad_(False)
    anchors = case.anchors
    valid = torch.ones(len(anchors), dtype=torch.bool)
    real = core.select_anchors
    core.select_anchors = lambda *a, **k: (anchors, valid)        # only anchor selection bypassed
    try:
        doc = torch.cumsum((case.pos == 0).long(), 0)[None]
        kw = dict(hidden_states=case.context[None], input_ids=case.ids[None], loss_mask=case.loss_mask[None].long(),
                  verifier_last_hidden_states=case.last[None], document_ids=doc, position_ids=case.pos[None])
        _, logits, *_ = ref._backbone_forward(**kw, max_anchors=len(anchors))
        _, loss, _ = ref(**kw, loss_config=resolve_loss_config("ce", "eager"), gamma=4.0, max_anchors=len(anchors),
                         per_position_loss_weight="dpace", dpace_alpha=0.5)
    finally:
        core.select_anchors = real
    loss.backward()
    grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    return logits.detach().reshape(-1, V), loss.detach(), grads


def _specforge(case):
    fam = pytest.importorskip("specforge.algorithms.common.dflash_family_model",
                              reason="specforge not installed (the `references` extra, .ci/run)")
    from specforge.modeling.draft.dflash import DFlashDraftModel

    b = case.block
    cfg = _layer_config(num_target_layers=6, block_size=b,
                        dflash_config={"target_layer_ids": list(LAYERS), "mask_token_id": 1})
    cfg._attn_implementation = "sdpa"
    draft = DFlashDraftModel(cfg)
    _load(draft, case)
    online = fam.OnlineDFlashModel(draft, case.head, case.embed, mask_token_id=1, block_size=b,
                                   attention_backend="sdpa", num_anchors=len(case.anchors), loss_decay_gamma=None,
                                   objective_chunk_blocks=2, loss_type="dflash")
    anchors = case.anchors[None]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    # SpecForge's trainer packs no documents: the draft model runs on the project's per-document mask and positions,
    # everything else (noise embedding, labels, weight mask, objective) is OnlineDFlashModel's own
    mask = dflash_attention_mask(case.pos, case.anchors, b)[None, None]
    positions = torch.cat([case.pos, (case.pos[case.anchors][:, None] + torch.arange(b)).reshape(-1)])[None]
    seen = {}

    def forward_blocks(input_ids, hidden_states, loss_mask):
        noise = online._create_noise_embed(input_ids, anchors, keep)
        out = draft(position_ids=positions, noise_embedding=noise, target_hidden=hidden_states, attention_mask=mask)
        seen["logits"] = case.head(out).detach()
        return anchors, keep, out

    online._forward_draft_blocks = forward_blocks
    loss, _, _ = online(case.ids[None], case.context[None], case.loss_mask[None].float())
    loss.backward()
    grads = {k: p.grad for k, p in draft.named_parameters() if p.grad is not None}
    return seen["logits"].reshape(-1, V), loss.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("fused", [False, True], ids=["loss", "fused"])
@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("preset", ["speculators", "specforge"])
def test_preset_equals_the_reference(preset, block, fused, record_property):
    case = _case(block)
    ref_logits, ref_loss, ref_grads = (_speculators if preset == "speculators" else _specforge)(case)
    logits, loss, grads = _ours(case, preset, fused)
    rows = torch.arange(len(case.anchors) * block)
    fwd = _rel(logits[rows], ref_logits[rows])
    assert fwd <= 1e-6, f"forward logits differ by {fwd:.2e} (relative to the largest logit)"
    assert _rel(loss, ref_loss) <= 1e-5, (float(loss), float(ref_loss))
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    worst = max(_rel(grads[k], ref_grads[k]) for k in grads)
    assert worst <= 1e-5, f"gradients differ by {worst:.2e} (relative)"
    record_property("max_diff", {"forward": fwd, "loss": _rel(loss, ref_loss), "grad": worst})
    print(f"{preset} B={block} {'fused' if fused else 'loss'}: forward {fwd:.1e}, loss {_rel(loss, ref_loss):.1e}, "
          f"grad {worst:.1e}")
