"""Live tensor bytes per logical device, measured while the interpreter runs (the CPU measuring stick).

A TorchDispatchMode sees every tensor an op returns; each new storage is charged to the logical device whose
node is running (or to the device set with `charge`) and released by a weakref callback when the storage dies,
which is how torch's MemTracker counts too (torch/distributed/_tools/mem_tracker.py). Peaks are kept per device
and per node. On CUDA the interpreter reads torch.cuda.max_memory_allocated instead.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's data: itself, or those inside a traceable wrapper subclass."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    out = []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            out += _plain(inner)
    return out


class LiveTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self.node_peak: dict[str, int] = defaultdict(int)
        self.device: str | None = None
        self.node: str | None = None
        self._refs: dict[int, tuple[weakref.ref, str, int]] = {}
        self._paused = 0

    def charge(self, device: str | None, node: str | None = None) -> None:
        if self._paused:
            device, node = None, None
        self.device, self.node = device, node

    @contextlib.contextmanager
    def paused(self):
        """Charge nothing new inside (what a node's run charges included) while storages counted before still
        release their bytes when they die: the one-process held-out evaluation runs the graph's nodes under this
        tracker, and memory.json compares the training steps with check's prediction (NOTE [Held-out evaluation
        under torchrun], train/heldout.py, says the same of the evaluation inside a torchrun job)."""
        prev = (self.device, self.node)
        self._paused += 1
        self.device, self.node = None, None
        try:
            yield
        finally:
            self._paused -= 1
            self.device, self.node = prev

    def adopt(self, t: torch.Tensor, device: str, charge: bool = True) -> None:
        """Charge a tensor that existed before tracking began (a weight) to `device`, once per device, and remember
        its storage so that views of it (a transposed weight) are not counted as new memory. A sharded weight (a
        DTensor) is its local shard."""
        for inner in _plain(t):
            self._adopt(inner, device, charge)

    def _adopt(self, t: torch.Tensor, device: str, charge: bool) -> None:
        st = t.untyped_storage()
        key = st.data_ptr() if st.nbytes() else id(st)
        self._refs.setdefault(key, (weakref.ref(st), "<adopted>", 0))
        if charge:
            self.live[device] += st.nbytes()
            self.peak[device] = max(self.peak[device], self.live[device])

    def receive(self, t: torch.Tensor, device: str) -> None:
        """A tensor that arrives on `device` as a transfer's output from outside the graph's nodes (a receive queue,
        the hidden-state cache's loader): from now on its storage is `device`'s. A storage already charged there
        (a receive buffer made by the trainer's _alloc) stays as it is; one charged elsewhere (the loader's host
        buffer that a CPU transfer hands over without a copy), or made before tracking began, is charged to `device`
        from here until it dies, as check counts a transfer's output (analysis/memory.py)."""
        for inner in _plain(t):
            if inner.device.type == "meta":
                continue
            st = inner.untyped_storage()
            key = st.data_ptr() if st.nbytes() else id(st)
            ref, dev, n = self._refs.get(key, (None, None, 0))
            if ref is not None and ref() is st and dev == device:
                continue
            if ref is not None and ref() is st and dev in self.live:
                del self._refs[key]
                self.live[dev] -= n
            self._count(st, device, st.nbytes())

    def _add(self, t: torch.Tensor, device: str | None) -> None:
        if device is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        if is_traceable_wrapper_subclass(t):
            # a DTensor of a sharded drafter, an all-gather's async result: the wrapper has no storage of its own,
            # and the plain tensors inside were made by the subclass's own dispatch, which this mode does not see
            # (a mode is off while its handler runs): count those, as torch's MemTracker does
            # (torch/distributed/_tools/common_utils.py, get_untyped_storages). Without it a sharded drafter's
            # AdamW state (zeros_like of each DTensor master) went uncounted.
            for inner in _plain(t):
                self._add(inner, device)
            return
        st = t.untyped_storage()
        key = st.data_ptr() if st.nbytes() else id(st)
        if key in self._refs and self._refs[key][0]() is not None:
            return
        self._count(st, device, st.nbytes())

    def _count(self, st, device: str, n: int) -> None:
        """Charge a storage of n bytes to `device` until it dies (or is resized)."""
        key = st.data_ptr() if n else id(st)

        def release(_ref, key=key, device=device, n=n):
            if self._refs.get(key, (None,))[0] is _ref:
                del self._refs[key]
                self.live[device] -= n

        self._refs[key] = (weakref.ref(st, release), device, n)
        self.live[device] += n
        if self.live[device] > self.peak[device]:
            self.peak[device] = self.live[device]
        if self.node is not None and device == self.device:
            self.node_peak[self.node] = max(self.node_peak[self.node], self.live[device])

    def _resized(self, st, old_key: int) -> None:
        """A storage resized in place (torch.UntypedStorage.resize_, which no dispatch mode sees): FSDP2 frees a
        unit's unsharded parameters with resize_(0) and allocates them again with resize_(size)
        (torch/distributed/fsdp/_fully_shard/_fsdp_param.py free_storage, alloc_storage), the storage object
        living on. Its bytes follow the resize, as torch's MemTracker counts them
        (torch/distributed/_tools/mem_tracker.py _track_resize); without this a freed unit stayed counted."""
        ref, device, n = self._refs.get(old_key, (None, self.device, 0))
        if ref is not None and ref() is not st:
            ref, device, n = None, self.device, 0
        if ref is None and device is None:
            return                          # a storage made before tracking, resized outside any device's node
        if ref is not None:
            del self._refs[old_key]
            self.live[device] -= n
        self._count(st, device, st.nbytes())

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            old_key = st.data_ptr() if st.nbytes() else id(st)
            out = orig(st, size)
            tracker._resized(st, old_key)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, self.device)
        return out



class CudaMeter:
    """Per-node peaks on CUDA devices: the allocator's peak statistics are reset before each window (a node's run,
    a backward, an optimizer step) and read after it. A device's peak is the largest of its windows."""

    def __init__(self):
        self.node_peak: dict[str, tuple[int, int]] = {}
        self.device_peak: dict[str, tuple[int, int]] = {}

    def window(self, device: str, torch_device: torch.device, name: str):
        meter = self

        class _Window:
            def __enter__(self):
                torch.cuda.reset_peak_memory_stats(torch_device)

            def __exit__(self, *exc):
                a = torch.cuda.max_memory_allocated(torch_device)
                r = torch.cuda.max_memory_reserved(torch_device)
                pa, pr = meter.node_peak.get(name, (0, 0))
                meter.node_peak[name] = (max(pa, a), max(pr, r))
                da, dr = meter.device_peak.get(device, (0, 0))
                meter.device_peak[device] = (max(da, a), max(dr, r))
                return False

        return _Window()
