"""A model's arch comes from its config's model_type when the graph omits it, and a config that contradicts the
declared arch is refused (issue 22, point 1). The refusals themselves are golden messages in tests/graphs/bad/
(qwen3_config_under_qwen3_5, llama_config_under_qwen3_5, arch_omitted_*, config_file_without_model_type,
foreign_config_key, set_model_type, arch_coming)."""

import json
import re
from pathlib import Path

import pytest

from dflash_graph.cli.main import main
from dflash_graph.models.qwen3_5 import Qwen35Dims
from dflash_graph.models.registry import ARCHS, COMING, FAMILY_KEYS, target_arch_of

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = ROOT / "graphs"


def qwen27b_variant(tmp_path, target_config=None) -> str:
    """graphs/qwen27b.toml in tmp_path without the target's `arch` line (its paths made absolute), with the
    target's config.json replaced by `target_config` if given."""
    text = (GRAPHS / "qwen27b.toml").read_text()
    text, n = re.subn(r'(\[models\.target\]\n)arch = "qwen3_5"\n', r"\1", text)
    assert n == 1
    if target_config is not None:
        (tmp_path / "target_config.json").write_text(json.dumps(target_config, indent=2))
        text = text.replace('"qwen27b/target_config.json"', '"target_config.json"')
    text = re.sub(r'"(tiny|qwen27b)/', lambda m: f'"{GRAPHS}/{m.group(1)}/', text)
    path = tmp_path / "graph.toml"
    path.write_text(text)
    return str(path)


def check_json(capsys, path, *args):
    code = main(["check", path, "--json", *args])
    out = capsys.readouterr()
    return code, json.loads(out.out) if out.out else None, out.err


def memory_of(js):
    return {k: v for k, v in js.items() if k in ("devices", "models", "verdict")}


def test_arch_from_model_type_checks_the_same(in_repo, tmp_path, capsys):
    code, declared, _ = check_json(capsys, "graphs/qwen27b.toml")
    code2, found, err = check_json(capsys, qwen27b_variant(tmp_path))
    assert code2 == code, err
    assert found["models"]["target"]["arch"] == "qwen3_5"
    assert memory_of(found) == memory_of(declared)


def test_multimodal_config_names_its_arch_twice(in_repo, tmp_path, capsys):
    """transformers' Qwen3_5Config: model_type qwen3_5 around a text_config of model_type qwen3_5_text."""
    text = json.loads((GRAPHS / "qwen27b" / "target_config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": text}
    code, declared, _ = check_json(capsys, "graphs/qwen27b.toml")
    # a graph's dims read the top level of a config ("target.hidden_size"), not its text_config: given here
    sizes = [f"dims.{d}={text[k]}" for d, k in (("hidden", "hidden_size"), ("vocab", "vocab_size"))]
    code2, found, err = check_json(capsys, qwen27b_variant(tmp_path, wrapped), *(a for s in sizes for a in ("--set", s)))
    assert code2 == code, err
    assert memory_of(found) == memory_of(declared)


def test_a_text_config_of_another_family_is_refused(in_repo, tmp_path, capsys):
    text = json.loads((GRAPHS / "qwen27b" / "target_config.json").read_text())
    wrapped = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_moe_text"}}
    code, _, err = check_json(capsys, qwen27b_variant(tmp_path, wrapped))
    assert code == 2 and "Traceback" not in err
    assert "models.target.config.text_config.model_type" in err and "'qwen3_5_moe_text'" in err
    assert "not modelled yet" in err


def test_qwen3_8b_config_would_be_another_network():
    """Why a Qwen3 config under qwen3_5 must be refused, never modelled: Qwen3.5's defaults fill in what it
    lacks, turning 3 of every 4 of its layers into Gated DeltaNet layers."""
    cfg = json.loads((ROOT / "tests/graphs/bad/qwen3_8b_config.json").read_text())
    dims = Qwen35Dims.from_config(cfg)
    assert dims.layer_types.count("linear_attention") == cfg["num_hidden_layers"] * 3 // 4
    assert target_arch_of(cfg["model_type"]) == "qwen3" and cfg["model_type"] not in COMING
    qwen3 = ARCHS["qwen3"].dims(cfg)     # what the Qwen3 arch reads of the same file: 36 plain attention layers
    assert qwen3.layer_types == ("full_attention",) * cfg["num_hidden_layers"]
    assert (qwen3.hidden_size, qwen3.vocab_size) == (cfg["hidden_size"], cfg["vocab_size"])


def test_model_type_table_matches_transformers():
    """The table is data (check imports no transformers), so it is held to transformers' own config classes
    here: every model_type is one transformers knows, and every key said to belong only to another family is a
    field of that family's config class and of no Qwen3.5 config."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    targets = [t for a in ARCHS.values() if a.target for t in a.model_types]
    for mt in [*targets, *COMING, *(t for a in ARCHS.values() for t in a.model_types)]:
        assert mt in CONFIG_MAPPING_NAMES or mt.removesuffix("_text") in CONFIG_MAPPING_NAMES, mt
    assert not set(targets) & set(COMING), "a modelled model_type is still listed as coming"
    qwen35 = set(Qwen3_5TextConfig().to_dict()) | set(Qwen3_5Config().to_dict())
    for fam, keys in FAMILY_KEYS.items():
        if fam in CONFIG_MAPPING_NAMES:
            have = set(AutoConfig.for_model(fam).to_dict()) | set(AutoConfig.for_model(fam).attribute_map)
        else:   # a text config of a multimodal family
            from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
            have = set(Qwen3_5MoeTextConfig().to_dict()) | set(Qwen3_5MoeTextConfig.attribute_map)
        assert keys <= have, (fam, keys - have)
        assert not keys & qwen35, (fam, keys & qwen35)


@pytest.mark.parametrize("mt", ["qwen3_5", "qwen3_5_text"])
def test_each_qwen3_5_model_type_finds_the_arch(mt):
    assert target_arch_of(mt) == "qwen3_5"
