"""The flags that shape the checked plan, read the same way by every command that compiles a graph (check, plan,
draw, explain, run): --set, --host-memory, --device-map, --expandable-segments, --no-rewrite, --without-rule,
--verify."""

from __future__ import annotations

from collections.abc import Sequence

from ..rewrite.pipeline import Plan, compile_graph


def plan_from_args(args) -> Plan:
    es = None if getattr(args, "expandable_segments", None) is None else args.expandable_segments == "on"
    args.overrides = [*args.overrides, *host_overrides(args)]
    if getattr(args, "device_map", None):
        args.overrides = [*args.overrides, *mapped_overrides(args)]
    return compile_graph(args.graph, args.overrides, rewrite=not getattr(args, "no_rewrite", False),
                         expandable_segments=es, verify=getattr(args, "verify", False),
                         rules_off=getattr(args, "rules_off", ()))


def host_overrides(args) -> list[str]:
    """--host-memory SIZE is [memory] host_memory for this command, read here so that a bad size names the flag."""
    text = getattr(args, "host_memory", None)
    if text is None:
        return []
    from ..errors import GraphError, Location, Problem
    from ..units import parse_bytes

    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise GraphError(Problem(f"--host-memory {e}", Location(None, None, None, f"--host-memory {text}"),
                                 hint="e.g. --host-memory 512GiB (the memory of the host the run will use)")) from None
    if n < 1:
        raise GraphError(Problem(f"--host-memory must be above 0, got {text!r}",
                                 Location(None, None, None, f"--host-memory {text}"), hint="e.g. --host-memory 512GiB"))
    return [f"memory.host_memory={n}"]


def mapped_overrides(args, extra: Sequence[str] = ()) -> list[str]:
    """--device-map rewrites the devices' torch names before check runs, so the prediction is for the devices the
    run will use (a CUDA graph mapped to CPU is predicted without the caching allocator). A device that moves from
    a GPU to the CPU takes the host's memory as its capacity (the GPU's capacity and its CUDA context outside the
    allocator no longer apply); all the CPU devices share that memory (analysis/memory.py, HostMemory)."""
    import fnmatch

    from ..analysis.memory import host_memory_bytes, is_cpu
    from ..exec.devices import parse_device_map
    from ..spec.loader import load_graph

    mapping = parse_device_map(args.device_map)
    if not mapping:
        return []
    spec = load_graph(args.graph, [*args.overrides, *extra])
    host = None
    out = []
    for name, dev in spec.devices.items():
        for pat, dst in mapping:
            if fnmatch.fnmatch(dev.torch, pat):
                out.append(f"devices.{name}.torch={dst}")
                if is_cpu(dst) and not is_cpu(dev.torch):
                    if host is None:
                        host = host_memory_bytes(spec)[0] or 0
                    if host:
                        out += [f"devices.{name}.capacity={host}", f"devices.{name}.outside_allocator=0"]
                break
    return out
