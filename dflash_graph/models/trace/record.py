"""Record, in program order, every storage a transformers forward allocates and when it is freed.

The recorder is a TorchDispatchMode placed above FakeTensorMode: it sees each aten op's outputs; a storage not
seen before is an allocation (its size in bytes, the tensor's shape and dtype, the op, the innermost module
running), and a weakref callback on the untyped storage records its free when the last reference drops. This is
how torch's MemTracker counts (torch/distributed/_tools/mem_tracker.py: `_WeakRefInfo`, weakref callbacks on
`untyped_storage()`); parameters, buffers and the inputs are registered first and never counted.

A causal LM's forward is cut into pieces by hooks on its top-level modules: `embed`, `prologue` (the model's
code between the embedding and the first layer: positions, masks, rotary), one `layer:<type>` per decoder layer,
`between` (the code after each layer), `norm`, `epilogue` (after the norm, until the body returns), `lm_head`
and `end`. Each piece's events are fitted separately (`fit.py`), so that a program can be composed for any
number and order of layers (`dflash_graph.models.programs`).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

#: the pieces a causal LM's forward is cut into, in order (`layer:<type>` and `between` repeat per layer)


@attrs.frozen
class Alloc:
    id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch."
    itemsize: int
    op: str  # aten overload, e.g. "aten.mm.default"
    module: str  # innermost module, relative to the piece's module ("" for the piece itself)


@attrs.frozen
class Free:
    id: int


@attrs.frozen
class Piece:
    name: str  # "embed", "prologue", "layer:full_attention", "between", ...
    events: tuple[Alloc | Free, ...]


@attrs.frozen
class Trace:
    pieces: tuple[Piece, ...]
    peak: int  # the live-bytes peak over the whole forward (what MemTracker reports as its activation peak)
    meta: dict[str, Any]

    def flat(self) -> list[Alloc | Free]:
        return [e for p in self.pieces for e in p.events]


class Recorder(TorchDispatchMode):
    """Storage lifetimes at the dispatch level; `pieces` after the run. Use `watch(model, segments)` first."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._size: dict[int, int] = {}
        self._next = 0
        self.live = 0
        self.peak = 0
        self._pieces: list[tuple[str, list]] = [("start", [])]
        self._stack: list[str] = []
        self._names: dict[int, str] = {}
        self._roots: dict[int, str] = {}
        self._handles: list = []

    # ---- setup ----
    def external(self, *tensors: torch.Tensor) -> None:
        """Storages that exist before the forward (weights, inputs): views of them are not allocations."""
        for t in tensors:
            self._seen[t.untyped_storage()] = -1

    def watch(self, model: torch.nn.Module, segments: dict[str, torch.nn.Module]) -> None:
        """Cut the forward into pieces at the given modules (piece name -> module); name every module for labels."""
        self.external(*model.parameters(), *model.buffers())
        for name, mod in model.named_modules():
            self._names[id(mod)] = name
        for piece, mod in segments.items():
            self._roots[id(mod)] = piece
            self._handles.append(mod.register_forward_pre_hook(self._enter))
            self._handles.append(mod.register_forward_hook(self._exit))
        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._push))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._pop))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter(self, mod, args):
        self._pieces.append((self._roots[id(mod)], []))

    def _exit(self, mod, args, out):
        after = {"embed": "prologue", "norm": "epilogue", "lm_head": "end"}.get(self._roots[id(mod)], "between")
        self._pieces.append((after, []))

    def _push(self, mod, args):
        self._stack.append(self._names.get(id(mod), type(mod).__name__))

    def _pop(self, mod, args, out):
        self._stack.pop()

    # ---- recording ----
    def _module(self) -> str:
        if not self._stack:
            return ""
        piece_root = next((n for n in reversed(self._stack) if self._is_root(n)), None)
        inner = self._stack[-1]
        if piece_root is None or inner == piece_root:
            return "" if piece_root is not None else inner
        return inner[len(piece_root) + 1:] if inner.startswith(piece_root + ".") else inner

    def _is_root(self, name: str) -> bool:
        return name in self._root_names

    @property
    def _root_names(self) -> set[str]:
        if not hasattr(self, "_rn"):
            self._rn = {self._names[i] for i in self._roots}
        return self._rn

    def _free(self, ident: int, _ref) -> None:
        self.live -= self._size.pop(ident)
        self._pieces[-1][1].append(Free(ident))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st in self._seen:
                continue
            ident = self._next
            self._next += 1
            n = st.nbytes()
            self._seen[st] = ident
            self._size[ident] = n
            weakref.finalize(st, self._free, ident, None)
            self.live += n
            self.peak = max(self.peak, self.live)
            self._pieces[-1][1].append(Alloc(ident, n, tuple(int(s) for s in t.shape),
                                             str(t.dtype).removeprefix("torch."), t.element_size(),
                                             str(func), self._module()))
        return out

    def pieces(self) -> tuple[Piece, ...]:
        return tuple(Piece(n, tuple(ev)) for n, ev in self._pieces)


@contextlib.contextmanager
def _no_gc():
    """Frees in refcount order only: a cycle collected at a random moment would make traces disagree."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def packing_as_run(packed: bool):
    """Make transformers' mask creation take, over fake tensors, the path it takes over real ones.

    `find_packed_sequence_indices` (masking_utils) computes the packed-sequence ids, then returns None when the
    positions never restart, unless `is_tracing(...)` is true, which it is for a FakeTensor: fake tensors would
    always build the dense mask. The wrapper runs the same ops (so their allocations are recorded, including the
    `(... == 0).all()` test) and returns None for one document per row, the ids for packed documents."""
    from transformers import masking_utils

    orig = masking_utils.find_packed_sequence_indices

    def find(position_ids):
        ids = orig(position_ids)
        if ids is not None and not packed:
            (ids[:, -1] == 0).all()
            return None
        return ids

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


def packed_positions(seq: int, docs: int) -> torch.Tensor:
    """position_ids [1, seq] of `docs` documents (the last takes the remainder), each restarting at 0."""
    n = max(1, seq // docs)
    parts = [torch.arange(n)] * (docs - 1)
    return torch.cat(parts + [torch.arange(seq - n * (docs - 1))])[None]


def trace_causal_lm(model_cls, config, seq: int, *, dtype: torch.dtype = torch.bfloat16,
                    packing: str = "documents", docs: int = 4) -> Trace:
    """One forward of `model_cls(config)` (a *ForCausalLM) over `seq` token ids, batch 1, under FakeTensorMode and
    torch.no_grad, use_cache=False: the pieces and the whole forward's live peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    with fake:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(config).eval()
        finally:
            torch.set_default_dtype(prev)
        ids = torch.zeros(1, seq, dtype=torch.long)
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    if packing == "mask":
        kwargs["position_ids"] = fake.from_tensor(packed_positions(seq, docs))
    rec = Recorder()
    inner = model.model
    segments = {"embed": inner.embed_tokens, "norm": inner.norm, "lm_head": model.lm_head}
    for i, layer in enumerate(inner.layers):
        segments[f"layer:{_layer_type(config, i)}@{i}"] = layer
    rec.watch(model, segments)
    rec.external(*[v for v in kwargs.values() if isinstance(v, torch.Tensor)])
    try:
        with _no_gc(), packing_as_run(packing == "mask"), fake, torch.no_grad(), rec:
            out = model(**kwargs)
            del out
    finally:
        rec.close()
    pieces = tuple(Piece(p.name.split("@")[0], p.events) for p in rec.pieces())
    return Trace(pieces, rec.peak, {"seq": seq, "dtype": str(dtype).removeprefix("torch."), "packing": packing})


def _layer_type(config, i: int) -> str:
    types = getattr(config, "layer_types", None)
    return types[i] if types else "decoder"


__all__ = ["Alloc", "Free", "Piece", "Recorder", "Trace", "packing_as_run", "trace_causal_lm"]
