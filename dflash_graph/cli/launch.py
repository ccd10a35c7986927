"""The torchrun section of `check`: ranks, what distribution adds to each device, busy time and the bottleneck."""

from __future__ import annotations

from ..analysis.launch import Launch, analyze_launch
from ..units import fmt_bytes, fmt_seconds


def launch_json(typed) -> dict:
    L = analyze_launch(typed)
    b = L.bottleneck()
    return {
        "world_size": L.world_size, "backend": L.backend,
        "devices": {n: {"rank": d.rank, "peers": list(d.peers), "nccl_bytes": d.nccl_bytes,
                        "receive_queue_bytes": d.receive_queue_bytes, "staging_bytes": d.staging_bytes,
                        "step_flops": d.flops, "busy_seconds": d.busy_seconds} for n, d in L.devices.items()},
        "rank_busy_seconds": {str(k): v for k, v in L.rank_busy().items()},
        "bottleneck": None if b is None else {"ranks": b[0], "devices": [d for k in b[0] for d in L.rank_devices(k)],
                                              "busy_seconds": b[1]},
        "send_recv": len(L.transfers),
    }


def _ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def render_launch(typed) -> str:
    L: Launch = analyze_launch(typed)
    spec = typed.ctx.spec
    lines = [f"launch: dflash-graph launch --nproc-per-node {L.world_size} run (torchrun, one process per rank; "
             f"{len(L.transfers)} send/recv per micro-batch over {L.backend}; without a launch, one process runs "
             "every device)"]
    w = max(len(n) for n in L.devices) + 1
    lines.append(f"  {'device':<{w}} {'rank':>4} {'peers':<12} {'recv queue':>11} {'staging':>8} "
                 f"{'NCCL':>9} {'step FLOPs':>11} {'busy/step':>10}")
    for n, d in L.devices.items():
        peers = ",".join(map(str, d.peers)) if d.peers else "-"
        if len(peers) > 12:
            peers = _ranks_text(list(d.peers))
        busy = fmt_seconds(d.busy_seconds) if d.busy_seconds is not None else "-"
        lines.append(f"  {n:<{w}} {d.rank:>4} {peers:<12} {fmt_bytes(d.receive_queue_bytes):>11} "
                     f"{fmt_bytes(d.staging_bytes):>8} {fmt_bytes(d.nccl_bytes):>9} {d.flops:>11.3g} {busy:>10}")
    if any(d.nccl_bytes for d in L.devices.values()):
        lines.append(f"  NCCL: {fmt_bytes(spec.launch.nccl_memory_per_peer)} per peer rank outside the allocator "
                     "([launch] nccl_memory_per_peer, declared, not measured), counted in each device's usable memory")
    b = L.bottleneck()
    if b is None:
        missing = [n for n, d in L.devices.items() if d.busy_seconds is None]
        lines.append(f"  busy time: not predicted ({', '.join(missing)} declare no throughput; "
                     "add e.g. throughput = \"400 TFLOP/s\" to [devices.<name>])")
        return "\n".join(lines)
    ranks, t = b
    busy = L.rank_busy()
    devs = [d for k in ranks for d in L.rank_devices(k)]
    who = f"{_ranks_text(ranks)} ({_devices_text(devs)})"
    line = f"  bottleneck: {who}, {fmt_seconds(t)} busy per step" + (" each" if len(ranks) > 1 else "")
    rest = sorted(k for k in busy if k not in ranks)
    if rest:
        parts = [f"{_ranks_text([k])} ({_devices_text(L.rank_devices(k))}) {fmt_seconds(busy[k])}, "
                 f"idle {1 - busy[k] / t:.0%} of the step" for k in rest[:4]]
        more = f" and {len(rest) - 4} more" if len(rest) > 4 else ""
        line += "; " + "; ".join(parts) + more
    lines.append(line)
    lines.append("  (FLOPs from each op's declared cost, backward 2x forward with trainable weights and 1x without; "
                 "time = FLOPs / the device's declared throughput; transfers not timed)")
    return "\n".join(lines)


def _devices_text(devs: list[str]) -> str:
    return f"{devs[0]}..{devs[-1]}" if len(devs) > 2 else ", ".join(devs)
