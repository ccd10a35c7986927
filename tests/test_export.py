"""Export to the DFlash draft format: loaded back by an independent reader that knows only the format (config.json
keys, the weight names z-lab's `DFlashDraftModel` and SGLang's loader use, transformers' Qwen3 modules), it
reproduces the trained drafter's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from dflash_graph.exec.devices import torch_devices
from dflash_graph.exec.models import ModelStore
from dflash_graph.models.nn.target import embedding, final_norm, lm_head
from dflash_graph.rewrite.pipeline import compile_graph
from dflash_graph.train.export import export


class RefLayer(nn.Module):
    """A decoder layer of the format: self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp, two layer norms."""

    def __init__(self, cfg):
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        a.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        a.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        a.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        a.q_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        a.k_norm = Qwen3RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, h, ctx, cos, sin):
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        a = self.self_attn
        q_len, c_len = h.shape[1], ctx.shape[1]
        x = self.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).view(1, q_len, self.nh, self.hd)).transpose(1, 2)
        k = torch.cat([a.k_proj(ctx), a.k_proj(x)], 1).view(1, c_len + q_len, self.nkv, self.hd)
        v = torch.cat([a.v_proj(ctx), a.v_proj(x)], 1).view(1, c_len + q_len, self.nkv, self.hd)
        k, v = a.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)        # no mask: the context is the prefix
        h = h + a.o_proj(o.transpose(1, 2).reshape(1, q_len, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class RefDraft(nn.Module):
    def __init__(self, cfg_dict):
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        super().__init__()
        cfg = Qwen3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "dflash_config")})
        self.ids = cfg_dict["dflash_config"]["target_layer_ids"]
        self.block = cfg_dict["dflash_config"]["block_size"]
        self.mask_token_id = cfg_dict["dflash_config"]["mask_token_id"]
        self.layers = nn.ModuleList(RefLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(len(self.ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)

    def forward(self, target_hidden, noise_embedding, position_ids):
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, ctx, cos, sin)
        return self.norm(h)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    plan = compile_graph(str(REPO / "graphs" / "tiny.toml"))
    store = ModelStore(plan.typed, torch_devices(plan.typed.ctx.spec))
    store.preload()
    drafter = store.drafters["drafter"]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():           # every weight different from its init, the norms too
        for p in drafter.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=g))
    target = store.full("target", "cpu")
    return plan, drafter, target


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_reproduces_the_drafters_logits(tiny, tmp_path, dtype):
    plan, drafter, target = tiny
    dims = plan.typed.ctx.models["drafter"].dims
    out = export(drafter, dims, final_norm(target).weight, target.config, tmp_path / "hf", dtype, norm_plus_one=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["torch_dtype"] == dtype
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "block_size": 4, "mask_token_id": 1,
                                    "num_target_layers": 6}
    sd = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in sd.values()} == {getattr(torch, dtype)}
    assert not any("embed" in k or "lm_head" in k for k in sd)
    ref = RefDraft(cfg).double()
    ref.load_state_dict({k: v.double() for k, v in sd.items()}, strict=False)
    missing = set(ref.state_dict()) - set(sd) - {k for k in ref.state_dict() if "rotary" in k}
    assert not missing and not set(sd) - set(ref.state_dict())            # exactly the format's names

    torch.manual_seed(0)
    t, a = 40, 30                                                          # context 0..29, block at 30..33
    ctx = torch.randn(t, 2 * dims.hidden_size)
    ids = torch.randint(2, dims.vocab_size, (t,))
    with torch.no_grad():
        ours = lm_head(target)(final_norm(target)(drafter(ctx, ids, torch.arange(t), torch.tensor([a]))))[0]
        block = torch.tensor([ids[a].item()] + [ref.mask_token_id] * (ref.block - 1))
        noise = embedding(target)(block)[None].double()
        h = ref(ctx[None, :a].double(), noise, torch.arange(a + ref.block)[None])
        theirs = F.linear(h, lm_head(target).weight.double())[0].float()
    if dtype == "float32":
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    else:                                                                  # bf16 weights: close, same argmax
        assert (theirs - ours).abs().max() < 0.05 * ours.abs().max()
        assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_export_is_servable_auto_map_mask_token_modes_and_no_silent_overwrite(tiny, tmp_path, capsys):
    """What the loaders need beyond the weights: z-lab's AutoModel loader the auto_map to DFlashDraftModel (its
    dflash.py copied in when given), SGLang the mask token's string as the target tokenizer spells that id; a
    serving container (another user) reads the files; an existing export is not replaced without --overwrite."""
    import os

    from dflash_graph.cli.main import main
    from dflash_graph.errors import GraphError
    from dflash_graph.train.corpus import load_tokenizer
    from dflash_graph.train.export import mask_token_string, tokenizer_path

    plan, drafter, target = tiny
    dims = plan.typed.ctx.models["drafter"].dims
    spec = plan.typed.ctx.spec
    mask = mask_token_string(tokenizer_path(spec), dims.mask_token_id)
    tok = load_tokenizer(REPO / "graphs" / "tiny" / "tokenizer.json")
    assert mask == tok.convert_ids_to_tokens(1) and tok.get_vocab()[mask] == dims.mask_token_id == 1
    modeling = tmp_path / "zlab_dflash.py"
    modeling.write_text("# stands in for z-lab's modeling file\n")
    out = tmp_path / "hf"
    export(drafter, dims, final_norm(target).weight, target.config, out, "float32", norm_plus_one=True,
           mask_token=mask, modeling_file=modeling)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["mask_token"] == mask and (out / "dflash.py").read_text() == modeling.read_text()
    um = os.umask(0)
    os.umask(um)
    for f in ("config.json", "model.safetensors", "dflash.py"):
        assert (out / f).stat().st_mode & 0o777 == 0o666 & ~um            # 0644 under the usual umask 022
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(GraphError, match="not overwrite a directory silently"):
        export(drafter, dims, final_norm(target).weight, target.config, out, "float32", norm_plus_one=True)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    export(drafter, dims, final_norm(target).weight, target.config, out, "bfloat16", norm_plus_one=True,
           overwrite=True)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    # the command refuses before it reads the run (here: a directory that is no run at all)
    assert main(["export", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: error: exists and is not empty" in err and "--overwrite" in err
