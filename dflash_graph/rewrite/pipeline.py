"""load -> build -> infer -> rewrite -> memory: what `check`, `plan` and `run` all start from."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..analysis.allocator import AllocatorConfig
from ..analysis.infer import Typed, build, infer
from ..analysis.memory import MemoryReport, analyze_memory, live_peaks
from ..analysis.parallel import placement_problems
from ..spec.loader import load_graph
from .engine import Applied, rewrite
from .rules import ALL_RULES, DEFAULT_TABLES


@attrs.frozen
class Plan:
    original: Typed
    typed: Typed                       # what runs: the rewritten graph, or the original under --no-rewrite
    applied: tuple[Applied, ...]
    memory: MemoryReport
    memory_before: MemoryReport | None  # the graph as written, when rewrites were applied
    rewritten: bool


def tables_without(rules_off: Sequence[str] = ()):
    """DEFAULT_TABLES without the named rules (`--without-rule`); an unknown name is bad input."""
    from ..errors import GraphError, Location, Problem, did_you_mean

    for name in rules_off:
        if name not in ALL_RULES:
            raise GraphError(Problem(f"unknown rule '{name}'{did_you_mean(name, list(ALL_RULES))}",
                                     Location(flag=f"--without-rule {name}"), hint="rules: " + ", ".join(ALL_RULES)))
    return [(p, [r for r in rules if r.name not in rules_off]) for p, rules in DEFAULT_TABLES]


def compile_typed(typed: Typed, rewrite_graph: bool = True, expandable_segments: bool | None = None,
                  verify: bool = False, rules_off: Sequence[str] = ()) -> Plan:
    spec = typed.ctx.spec
    problems = placement_problems(typed)   # where the trainable model sits: NOTE [Data-parallel placement]
    if problems:
        from ..errors import GraphError

        raise GraphError(problems)
    alloc = AllocatorConfig(
        expandable_segments=spec.memory.expandable_segments if expandable_segments is None else expandable_segments,
        max_split_size_bytes=spec.memory.max_split_size)
    if not rewrite_graph:
        return Plan(typed, typed, (), analyze_memory(typed, alloc), None, False)
    new, applied = rewrite(typed, tables_without(rules_off), live_peaks, verify=verify)
    before = analyze_memory(typed, alloc) if applied else None
    return Plan(typed, new, tuple(applied), analyze_memory(new, alloc), before, True)


def compile_graph(path: str, overrides: Sequence[str] = (), rewrite: bool = True,
                  expandable_segments: bool | None = None, verify: bool = False,
                  rules_off: Sequence[str] = ()) -> Plan:
    spec = load_graph(path, overrides)
    graph, ctx = build(spec)
    return compile_typed(infer(graph, ctx), rewrite, expandable_segments, verify, rules_off)
