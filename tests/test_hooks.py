"""hook_capture: layers hooked on a forward's taps, allocated during that forward, dropped when no one reads them."""

import pytest
import torch

from dflash_graph.analysis.infer import build, infer
from dflash_graph.errors import GraphError
from dflash_graph.ir.graph import Ref
from dflash_graph.rewrite.pipeline import compile_graph, compile_typed
from dflash_graph.spec.loader import parse_graph



def minimal_with(extra: str) -> str:
    from pathlib import Path

    return (Path(__file__).parent / "graphs" / "minimal.toml").read_text() + extra


HOOK = """
[[nodes]]
id = "hooks"
op = "hook_capture"
model = "target"
device = "a"
inputs = { taps = "body.taps" }
params = { layers = [0, 1] }
"""


def test_unread_hooked_layers_are_dropped_and_the_forward_stops_hooking_them():
    text = minimal_with(HOOK + """
[[nodes]]
id = "keep"
op = "output"
device = "a"
inputs = { x = "hooks.layer0" }
""")
    typed = infer(*build(parse_graph(text, "g.toml")))
    plan = compile_typed(typed)
    assert dict(plan.typed.graph["hooks"].params)["layers"] == [0]
    assert ("drop_unused", ("hooks",)) in [(a.rule, a.nodes) for a in plan.applied]
    from dflash_graph.analysis.nodecost import hook_refs

    assert set(hook_refs(plan.original, "body")) == {0, 1}
    assert set(hook_refs(plan.typed, "body")) == {0}     # the forward no longer hooks (or keeps) layer 1


def test_a_hook_no_one_reads_is_removed():
    plan = compile_typed(infer(*build(parse_graph(minimal_with(HOOK), "g.toml"))))
    assert "hooks" not in plan.typed.graph


def test_a_layer_hooked_twice_is_an_error():
    text = minimal_with(HOOK + HOOK.replace('id = "hooks"', 'id = "hooks2"').replace("[0, 1]", "[1]"))
    with pytest.raises(GraphError, match=r"layer\(s\) \[1\] of 'body' are already hooked by 'hooks'"):
        infer(*build(parse_graph(text, "g.toml")))


def test_the_hook_names_the_forwards_model():
    text = minimal_with(HOOK).replace('[models.target]', '[models.other]\narch = "qwen3_5"\ndtype = "float32"\n'
                                      'config = { vocab_size = 8, hidden_size = 32 }\n\n[models.target]')
    text = text.replace('op = "hook_capture"\nmodel = "target"', 'op = "hook_capture"\nmodel = "other"')
    with pytest.raises(GraphError, match="reads the taps of 'body'"):
        infer(*build(parse_graph(text, "g.toml")))


def test_hooked_layers_at_run_time_are_the_decoder_layer_outputs(in_repo):
    """Through the graph: hooks.layer<i> equals transformers' hidden_states[i + 1]."""
    from dflash_graph.exec.devices import torch_devices
    from dflash_graph.exec.interpreter import Interpreter
    from dflash_graph.exec.models import ModelStore

    plan = compile_graph("graphs/tiny.toml")
    typed = plan.typed
    tdev = torch_devices(typed.ctx.spec)
    store = ModelStore(typed, tdev)
    store.preload()
    interp = Interpreter(typed, store, tdev, track_memory=False)
    ids = torch.randint(2, 700, (256,))
    batch = {"input_ids": ids, "position_ids": torch.arange(256), "loss_mask": torch.ones(256, dtype=torch.bool)}
    with torch.no_grad():
        res = interp.run_replica(0, lambda r: batch, keep=frozenset({Ref("hooks", "layer1"), Ref("hooks", "layer3")}))
        hs = store.full("target", "cpu")(input_ids=ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(res["hooks"]["layer1"], hs[2][0])
    torch.testing.assert_close(res["hooks"]["layer3"], hs[4][0])
