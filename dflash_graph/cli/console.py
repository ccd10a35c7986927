"""What the console shows: rich tables on a terminal, plain text otherwise; OOMs once per distinct failure, with
the tensor named by its node, output and shape rather than by an internal replay key.

Plain text is used when stdout is not a terminal, when NO_COLOR is set (https://no-color.org), or when rich is
not installed; what the tests and pipes read is always the plain form.
"""

from __future__ import annotations

import os
import re
import sys

from ..analysis.infer import Typed
from ..analysis.memory import MemoryReport, Oom
from ..ir.graph import Ref
from ..units import fmt_bytes


def use_rich(stream=None) -> bool:
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR") or not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def rich_console(**kw):
    """A rich Console that lets a closed pipe reach `dflash-graph`'s entry point (cli/main.py ends it quietly, with
    the same exit status for every command) instead of rich's own SystemExit(1), which `check` uses for an OOM."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console(**kw)


# -- naming what failed to allocate ---------------------------------------------------------------------------

_TEMP = re.compile(r"^(?:l(?P<layer>\d+)|(?P<part>pro|norm))\.(?P<name>.+?)#\d+$")
_OUT = re.compile(r"^(?P<port>\w+) (?P<shape>\[[^\]]*\]) (?P<dtype>\w+)(?: \(hooked by (?P<hook>\w+)\))?$")


def _typed_str(typed: Typed | None, ref: str) -> str:
    if typed is None or "." not in ref:
        return ref
    node, _, out = ref.partition(".")
    t = typed.types.get(Ref(node, out))
    return f"{ref} {t.concrete_str()} {t.dtype}" if t is not None else ref


def describe_tensor(o: Oom, typed: Typed | None = None) -> str:
    """'verifier_roll.out [65,536, 248,320] bfloat16' for an output; for a temporary inside a forward, its layer
    and name; for backward, which gradient."""
    what = o.tensor
    if m := _OUT.match(what):
        owner = m["hook"] or o.node
        return f"{owner}.{m['port']} {m['shape']} {m['dtype']}" + (f" (made inside '{o.node}')" if m["hook"] else "")
    if m := _TEMP.match(what):
        where = f"decoder layer {m['layer']}" if m["layer"] else {"pro": "the prologue", "norm": "the final norm"}[m["part"]]
        return f"a {fmt_bytes(o.requested_bytes)} temporary ({m['name'].strip()}) of {where} inside '{o.node}'"
    if what.startswith("backward grad of "):
        return "the gradient of " + _typed_str(typed, what[len("backward grad of "):])
    if what.startswith("backward weight grad "):
        return "the weight gradient of " + what[len("backward weight grad "):]
    if what in ("ws", "backward workspace"):
        kind = "backward workspace" if what.startswith("backward") else "workspace"
        return f"the {kind} of '{o.node}' ({fmt_bytes(o.requested_bytes)} of temporaries while it runs)"
    if what == "saved for backward":
        return f"the tensors autograd saves for backward in '{o.node}' ({fmt_bytes(o.requested_bytes)})"
    return re.sub(r" #\d+$", "", what)        # the replay's own key for a temporary is not for users


def span(devices: list[str]) -> str:
    return f"{devices[0]}..{devices[-1]} ({len(devices)} devices)" if len(devices) > 2 else ", ".join(devices)


def grouped_ooms(mem: MemoryReport) -> list[tuple[list[str], Oom]]:
    """One entry per distinct failure: the replicas of a group that fail the same way are one."""
    groups: dict[tuple, tuple[list[str], Oom]] = {}
    for o in mem.ooms:
        key = (o.node, o.tensor, o.requested_bytes, o.free_bytes, o.reserved_bytes, o.allocated_bytes,
               o.capacity_bytes)
        groups.setdefault(key, ([], o))[0].append(o.device)
    return list(groups.values())


# -- tables ---------------------------------------------------------------------------------------------------

def print_memory_table(mem: MemoryReport, before: MemoryReport | None = None) -> None:
    """The memory table of `check`, as a rich table (call only when use_rich())."""
    from rich.table import Table

    t = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for col in ("device", "torch", "capacity", "usable", "weights", "optim", "allocated", "reserved", "headroom",
                "peak at"):
        t.add_column(col, justify="left" if col in ("device", "torch", "peak at") else "right")
    if before is not None:
        t.add_column("as written (allocated / reserved)", justify="right")
    for name, d in mem.devices.items():
        head = fmt_bytes(d.headroom_bytes)
        row = [name, d.torch, fmt_bytes(d.capacity_bytes), fmt_bytes(d.usable_bytes), fmt_bytes(d.weight_bytes),
               fmt_bytes(d.optimizer_bytes), fmt_bytes(d.peak_bytes), fmt_bytes(d.reserved_peak_bytes),
               f"[red]{head}[/red]" if d.oom else f"[green]{head}[/green]",
               d.peak_node + ("  [bold red]OOM[/bold red]" if d.oom else "")]
        if before is not None:
            b = before.devices.get(name)
            row.append(f"{fmt_bytes(b.peak_bytes)} / {fmt_bytes(b.reserved_peak_bytes)}" if b else "")
        t.add_row(*row)
    rich_console().print(t)
