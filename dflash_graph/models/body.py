"""A target body forward's allocation events, in the form the cost code folds into a node's program
(ops/costs.py `_body_steps`), whatever the arch: the hand mirror's replay (models/qwen3_5.py) and a derived
program (models/decoder.py) both produce one. Pure Python, no torch.

Events are (event, bytes): "+name" allocates, "-name" frees, "~old>new" renames. A layer chunk writes its own
output as "+h_out" (the cost code keys it: a tap, the node's `hidden` output or a per-layer key) and never frees
its input (the cost code frees the previous layer's output after the layer, unless a node owns it). The final
chunk may free "@embeds" (the embedding output) and "@prev" (the last layer's output, unless a node owns it):
where a forward frees them is part of its memory (transformers' models keep the embedding output alive until
the body returns).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

Events = tuple[tuple[str, int], ...]


@attrs.frozen
class BodyEvents:
    prologue: Events                  # after the embedding, before layer 0: positions, the mask, rotary cos/sin
    layers: Mapping[tuple[str, bool], Events]   # (layer type, not the first layer) -> that layer's events
    final: Events                     # after the last layer: the final norm and what dies when the body returns
    label: Callable[[str], str]       # an event name -> the words an OOM report shows for that tensor
    embeds_to_end: bool = False       # the embedding output lives until "-@embeds" (else: freed after layer 0)
