"""The validated graph document: frozen attrs values, each remembering where it was written."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path as FsPath
from types import MappingProxyType
from typing import Any

import attrs

from ..errors import Location
from .toml_lines import LineIndex, Path, render_path


def frozen_map(d: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@attrs.frozen
class DeviceSpec:
    name: str
    torch: str
    capacity: int
    outside_allocator: int
    rank: int | None = None
    throughput: float | None = None     # FLOP/s
    node: int = 0                       # the machine it is on (collectives across nodes: inter_node_bandwidth)


@attrs.frozen
class LaunchSpec:
    nccl_memory_per_peer: int = 256 * 2**20
    stall_timeout: float = 30.0
    backend: str = "auto"
    intra_node_bandwidth: float = 450e9     # bytes/s per device for collectives within a node
    inter_node_bandwidth: float = 50e9      # bytes/s per device for collectives across nodes


@attrs.frozen
class ModelSpec:
    name: str
    arch: str | None                   # None: from the config's model_type (analysis/model_arch.py)
    config: Mapping[str, Any]
    dtype: str
    trainable: bool
    weights: str | None
    shares: Mapping[str, str]          # component -> "model.component"
    config_file: str | None = None     # where config came from, if a file
    forward: Mapping[str, Any] = attrs.field(factory=dict)   # attn_implementation/packing/linear_kernels declared
    parallel: str | None = None        # "ddp" | "fsdp": data-parallel over its nodes' device group; None: one device


@attrs.frozen
class NodeSpec:
    index: int                          # position in [[nodes]], for TOML paths
    id: str
    op: str
    inputs: Mapping[str, str] | tuple[str, ...]   # port -> "node.output", or positional
    params: Mapping[str, Any]
    device: str
    model: str | None = None
    note: str | None = None             # comment written above the node by `plan --emit`


@attrs.frozen
class MemorySpec:
    expandable_segments: bool = False
    max_split_size: int | None = None
    host_memory: int | None = None      # declared memory of the host the CPU devices share (None: MemAvailable)


@attrs.frozen
class GraphSpec:
    file: str | None
    name: str
    dims: Mapping[str, int | str]
    devices: Mapping[str, DeviceSpec]
    groups: Mapping[str, tuple[str, ...]]
    models: Mapping[str, ModelSpec]
    nodes: tuple[NodeSpec, ...]
    memory: MemorySpec
    train: Mapping[str, Any]
    data: Mapping[str, Any]
    lines: LineIndex = attrs.field(eq=False, repr=False)
    description: str = ""
    launch: LaunchSpec = LaunchSpec()
    capture: Mapping[str, Any] = attrs.field(factory=dict)   # [capture]: the hidden-state cache (docs/offline.md)
    # the whole document as loaded, --set applied and config.json files read in: what a run records, and what a
    # resume compares against (train/rundir.py)
    resolved: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def loc(self, *path: str | int) -> Location:
        p: Path = tuple(path)
        return Location(self.file, self.lines.line_of(p), render_path(p) if p else None, self.lines.flag_of(p))

    def node_loc(self, node: NodeSpec, *sub: str | int) -> Location:
        return self.loc("nodes", node.index, *sub)

    def rank_of(self, device: str) -> int:
        """The torchrun rank that owns a device: its declared `rank`, else its index in [devices]."""
        d = self.devices[device]
        return d.rank if d.rank is not None else list(self.devices).index(device)

    @property
    def base_dir(self) -> FsPath:
        """The graph file's directory: the paths a graph names are relative to it."""
        return FsPath(self.data.get("_base", "."))

    @property
    def world_size(self) -> int:
        return len({self.rank_of(d) for d in self.devices})

    def placement(self, device: str) -> tuple[str, ...]:
        """Physical devices a node placed on `device` (a device or a group) runs on."""
        return self.groups.get(device, (device,))
