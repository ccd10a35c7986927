"""Logical devices of a graph to torch devices, with --device-map remapping ('cuda:*=cpu')."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from ..errors import GraphError, Location, Problem
from ..spec.document import GraphSpec


def parse_device_map(items: Sequence[str]) -> list[tuple[str, str]]:
    """[(FROM pattern, TO device)]; TO must be a torch device a graph may declare (checked without torch)."""
    from ..spec.loader import valid_torch_device

    out = []
    for it in items:
        src, sep, dst = it.partition("=")
        if not sep or not src.strip() or not dst.strip():
            raise GraphError(Problem(f"expected FROM=TO, got {it!r}", Location(flag=f"--device-map {it}"),
                                     hint="e.g. --device-map 'cuda:*=cpu' or --device-map cuda:7=cuda:1"))
        if not valid_torch_device(dst.strip()):
            raise GraphError(Problem(f"{dst.strip()!r} is not a torch device", Location(flag=f"--device-map {it}"),
                                     expected="cpu, cuda or cuda:N after the '='",
                                     hint="e.g. --device-map 'cuda:*=cpu' or --device-map cuda:7=cuda:1"))
        out.append((src.strip(), dst.strip()))
    return out


def torch_devices(spec: GraphSpec, device_map: Sequence[tuple[str, str]] = (),
                  only: Sequence[str] | None = None) -> dict[str, str]:
    """Logical device name -> torch device string after remapping; checks that each exists on this machine (only
    the devices in `only`, under torchrun: the others belong to other processes, maybe on other machines)."""
    import torch

    out = {}
    for name, dev in spec.devices.items():
        t = dev.torch
        for pat, dst in device_map:
            if fnmatch.fnmatch(t, pat):
                t = dst
                break
        out[name] = t
    for name, t in out.items():
        if only is not None and name not in only:
            continue
        why = device_problem(t)
        if why is not None:
            raise GraphError(Problem(
                f"device '{name}' maps to {t}: {why}", spec.loc("devices", name, "torch"),
                hint="run on CPU with --device-map 'cuda:*=cpu' (small dims: --set dims.seq=...), or remap "
                     "devices with --device-map cuda:7=cuda:0"))
    return out


def device_problem(t: str) -> str | None:
    """Why this process cannot run on the torch device `t` ('cpu', 'cuda', 'cuda:N'), or None."""
    import torch

    try:
        dev = torch.device(t)
    except RuntimeError:
        return "not a torch device (expected cpu, cuda or cuda:N)"
    if dev.type == "cpu":
        return None
    if dev.type == "meta":
        return "the meta device holds no data: nothing can run on it"
    if dev.type != "cuda":
        try:
            torch.empty(0, device=dev)
        except Exception as e:   # torch says why in its own exception types (RuntimeError, NotImplementedError)
            return f"not available here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (dev.index or 0) < n:
        return None
    if not torch.backends.cuda.is_built():
        return f"this torch ({torch.__version__}) is built without CUDA"
    return f"this machine has {n} CUDA device(s)" if n else "this machine has no CUDA device"
