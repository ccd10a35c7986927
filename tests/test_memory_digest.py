"""The memory model's predicted figures are byte-identical to those of the replay before it was made faster
(tests/memory_digest.py: peaks, peak nodes, OOMs, timelines, labels and allocation events, on tiny, minimal at
64 to 500 layers, qwen27b, hooked layers in the middle and at the end, bf16/fp32, expandable segments, as written
and rewritten)."""

import json
from pathlib import Path

import pytest

from memory_digest import CASES, all_digests

GOLDEN = json.loads((Path(__file__).parent / "memory_digests.json").read_text())


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_figures_unchanged(name):
    assert all_digests([name])[name] == GOLDEN[name]
