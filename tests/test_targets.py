"""Every target arch runs through transformers' own class (models/nn/target.py): built from a config or from local
weights (one file, sharded, tied embeddings; a key the config's model lacks refused), hooked on its decoder
layers, its final norm exported as the drafter's plain norm that equals it, and the tiny Qwen3 and Qwen3-MoE
graphs train, eval and export through the CLI into the format the existing export test reads."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_graph.models.nn.target import body_forward, build_target, final_norm, load_config
from dflash_graph.models.registry import ARCHS
from dflash_graph.train.export import state_dict

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"qwen3": REPO / "graphs/tiny_qwen3", "qwen3_moe": REPO / "graphs/tiny_moe", "qwen3_5": REPO / "graphs/tiny"}


def _random(arch: str, dtype=torch.float32, **changes):
    cfg = {**json.loads((CONFIGS[arch] / "config.json").read_text()), **changes}
    torch.manual_seed(0)
    model = build_target(cfg, None, dtype, "cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():               # every weight away from its init (the norms' 1 or 0 too)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    return cfg, model


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5"])
def test_each_target_is_its_registry_class_and_hooks_its_layers(arch):
    """The class transformers names for the arch; layer i's hook is transformers' own hidden_states[i + 1]."""
    _, model = _random(arch)
    assert type(model).__name__ == ARCHS[arch].hf_causal_lm
    ids = torch.randint(2, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(40)
    with torch.no_grad():
        last, cap = body_forward(model, ids, pos, [1, 3])
        ref = model.model(input_ids=ids[None], position_ids=pos[None], output_hidden_states=True, use_cache=False)
    n = model.config.num_hidden_layers
    torch.testing.assert_close(cap[1], ref.hidden_states[2][0])
    torch.testing.assert_close(cap[3], ref.hidden_states[4][0])
    assert last.shape == (40, model.config.hidden_size) and n == 6
    torch.testing.assert_close(final_norm(model)(last), ref.last_hidden_state[0])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_weights_load_from_one_file_or_shards(arch, tmp_path):
    cfg, model = _random(arch)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    keys = sorted(sd)
    half = len(keys) // 2
    shards = tmp_path / "sharded"
    shards.mkdir()
    for i, part in enumerate((keys[:half], keys[half:])):
        save_file({k: sd[k] for k in part}, str(shards / f"model-0000{i + 1}-of-00002.safetensors"))
    (shards / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f"model-0000{1 + (k in keys[half:])}-of-00002.safetensors" for k in keys}}))
    for weights in (tmp_path / "model.safetensors", tmp_path, shards):
        back = build_target(CONFIGS[arch], weights, torch.float32, "cpu")
        for k, v in back.state_dict().items():
            assert torch.equal(v, sd[k]), (weights, k)

    extra = dict(sd, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected.*layers.9"):
        build_target(cfg, tmp_path / "extra.safetensors", torch.float32, "cpu")
    short = {k: v for k, v in sd.items() if "layers.5." not in k}
    save_file(short, str(tmp_path / "short.safetensors"))
    with pytest.raises(ValueError, match="missing.*layers.5"):
        build_target(cfg, tmp_path / "short.safetensors", torch.float32, "cpu")


def test_tied_embeddings_load_without_an_lm_head(tmp_path):
    cfg, model = _random("qwen3", tie_word_embeddings=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    back = build_target(cfg, tmp_path, torch.float32, "cpu")
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    assert torch.equal(back.lm_head.weight, sd["model.embed_tokens.weight"])


def test_a_config_of_another_family_is_refused():
    cfg = json.loads((CONFIGS["qwen3"] / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type 'qwen3'"):
        load_config(cfg, "llama")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_exported_norm_is_the_targets_own_final_norm(arch):
    """The drafter's exported norm.weight in the readers' plain RMSNorm (transformers' Qwen3RMSNorm, w * x/rms(x))
    gives what the target's own final norm gives: Qwen3's w, Qwen3.5's 1 + w."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    _, model = _random(arch)
    own = final_norm(model)
    out = state_dict(nn.Module(), own.weight, torch.float32, ARCHS[arch].norm_plus_one)
    plain = Qwen3RMSNorm(model.config.hidden_size, eps=model.config.rms_norm_eps)
    plain.load_state_dict({"weight": out["norm.weight"]})
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), own(x))
        if ARCHS[arch].norm_plus_one:     # the (1 + w) norm is not the plain one on the same weight
            assert not torch.allclose(Qwen3RMSNorm(x.shape[-1], model.config.rms_norm_eps)(x) * own.weight, own(x))


@pytest.mark.parametrize("graph", ["tiny_qwen3", "tiny_moe"])     # about 5 s each on a 2-core machine
def test_tiny_target_trains_evals_and_exports(in_repo, tmp_path, capsys, graph):
    """run, eval and export through the CLI; the export loads in the independent reader of tests/test_export.py
    and reproduces the trained drafter's logits."""
    from dflash_graph.cli.main import main
    from test_export import RefDraft

    out = tmp_path / "run"
    assert main(["run", f"graphs/{graph}.toml", "--out", str(out), "--no-progress", "--strict"]) == 0
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in metrics if "loss" in r][-1] == 4
    capsys.readouterr()
    code = main(["eval", f"graphs/{graph}.toml", "--checkpoint", str(out), "--prompts", "2", "--max-new-tokens", "6",
                 "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and res["identical_to_greedy"] == res["prompts"] == 2
    hf = tmp_path / "hf"
    assert main(["export", str(out), "--out", str(hf), "--dtype", "float32"]) == 0
    cfg = json.loads((hf / "config.json").read_text())
    sd = load_file(str(hf / "model.safetensors"))
    ref = RefDraft(cfg)
    ref.load_state_dict(sd, strict=False)
    assert not set(sd) - set(ref.state_dict())

    from dflash_graph.rewrite.pipeline import compile_graph
    from dflash_graph.train.trained import Trained

    tr = Trained(compile_graph(f"graphs/{graph}.toml"), out)
    assert not tr.norm_plus_one
    assert torch.equal(sd["norm.weight"], final_norm(tr.target).weight.float())     # w, not 1 + w
    t, a = 30, 20
    g = torch.Generator().manual_seed(5)
    ctx = torch.randn(t, 2 * cfg["hidden_size"], generator=g).to(torch.bfloat16)
    ids = torch.randint(2, cfg["vocab_size"], (t,), generator=g)
    with torch.no_grad():
        ours = tr.target.lm_head(final_norm(tr.target)(tr.drafter(ctx, ids, torch.arange(t), torch.tensor([a]))))[0]
        block = torch.tensor([ids[a].item()] + [ref.mask_token_id] * (ref.block - 1))
        noise = tr.target.model.embed_tokens(block)[None].float()
        h = ref(ctx[None, :a].float(), noise, torch.arange(a + ref.block)[None])
        theirs = torch.nn.functional.linear(h, tr.target.lm_head.weight.float())[0]
    assert (theirs - ours.float()).abs().max() < 0.05 * ours.float().abs().max()
    assert (theirs.argmax(-1) == ours.float().argmax(-1)).float().mean() >= 0.75


def test_mask_token_rule_for_a_vocabulary_with_and_without_a_spare_token():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from dflash_graph.models.nn.target import load_tokenizer, mask_token_rule

    assert mask_token_rule(load_tokenizer(REPO / "graphs/tiny/tokenizer.json"), 768)[0] == 1      # its <|mask|>

    def tok(words, **special):
        return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({w: i for i, w in enumerate(words)},
                                                                            unk_token=words[0])), **special)

    llama_like = tok(["<unk>", "a", "<|reserved_special_token_0|>", "<|end_of_text|>"])
    assert mask_token_rule(llama_like, 6)[0] == 4            # embedding rows past the tokenizer: the first
    assert mask_token_rule(llama_like, 4)[0] == 2            # no spare row: the reserved token
    bare = tok(["<unk>", "a", "<pad>"], pad_token="<pad>")
    id_, why = mask_token_rule(bare, 3)
    assert id_ == 2 and "no spare token" in why              # the last resort says what it costs


def test_a_drafter_config_without_a_mask_token_says_what_to_set():
    from dflash_graph.models.dflash import CONFIG_KEYS, DFlashDims

    cfg = {k: 4 for k in CONFIG_KEYS} | {"target_layer_ids": [1, 3], "rms_norm_eps": 1e-6, "rope_theta": 1e4,
                                         "vocab_size": 768, "hidden_size": 128, "target_hidden_size": 128}
    del cfg["mask_token_id"]
    with pytest.raises(ValueError, match=r"mask_token_id.*<\|mask\|>.*docs/drafter.md"):
        DFlashDims.from_config(cfg)
