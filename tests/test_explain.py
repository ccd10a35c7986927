"""`dflash-graph explain GRAPH NODE`: contract, shapes, formulas with the dims substituted, rewrites."""

from dflash_graph.cli.main import main


def explain(capsys, *args):
    code = main(["explain", *args])
    return code, capsys.readouterr()


def test_explain_lm_head_after_the_rewrite(in_repo, capsys):
    # without the fusion, which computes this head inside the loss (test below)
    code, out = explain(capsys, "graphs/qwen27b.toml", "verifier_lm_head", "--without-rule", "fuse_heads_into_loss")
    text = out.out
    assert code == 0
    assert "contract (ops/catalog.py, op 'lm_head')" in text and "[*batch hidden]" in text
    assert "bfloat16 [anchors, block, vocab] = [512, 16, 248,320]: 3.79 GiB (2*anchors*block*vocab bytes)" in text
    # the FLOPs formula, from the cost function, evaluated on symbols and on the values
    assert "2*anchors*block*hidden*vocab" in text and f"{2 * 512 * 16 * 5120 * 248320:.3g}" in text
    assert "dflash_graph/ops/costs.py" in text and "PaLM appendix B" in text
    assert "gather_through_positionwise" in text and "legal by Traits.positionwise" in text


def test_explain_a_head_the_fusion_removed(in_repo, capsys):
    code, out = explain(capsys, "graphs/qwen27b.toml", "verifier_lm_head")
    assert code == 0 and "removed by the rewrites" in out.out
    assert "fuse/fuse_heads_into_loss on loss, drafter_lm_head, verifier_lm_head" in out.out
    assert "legal by Traits.fuses_heads + Traits.linear_head" in out.out


def test_explain_a_node_the_rewrites_removed(in_repo, capsys):
    code, out = explain(capsys, "graphs/qwen27b.toml", "verifier_roll")
    assert code == 0
    assert "removed by the rewrites" in out.out and "drop_unused" in out.out and "gather_through_remap" in out.out
    assert "[seq, vocab] = [65,536, 248,320]: 30.31 GiB" in out.out


def test_explain_as_written_and_bad_node(in_repo, capsys):
    code, out = explain(capsys, "graphs/qwen27b.toml", "target", "--no-rewrite")
    assert code == 0 and "op causal_lm_forward" in out.out and "rewrites: off (--no-rewrite)" in out.out
    code, out = explain(capsys, "graphs/qwen27b.toml", "verifer_roll")
    assert code == 2 and "no node 'verifer_roll'" in out.err and "did you mean 'verifier_roll'" in out.err
