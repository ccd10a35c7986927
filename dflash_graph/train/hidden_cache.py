"""The hidden-state cache with torch: `dflash-graph capture` runs the graph's target side and writes what crosses
its transfers (CacheWriter, capture); `run --hidden-states DIR` reads it back as the drafter side's receives
(CacheSource). What a cache holds, its signature and manifest: analysis/capture.py; docs/offline.md.

NOTE [Sample order]: sample i of a cache is replica r of micro-batch a of step s, i = (s * grad_accum + a) * R + r,
its data the r-th replica shard's next packed sequence and its anchors drawn from the generator the trainer seeds
with (seed, s, a, r) (train/trainer.micro_generator). A run from the cache reads the samples in that order, so
its step s sees exactly the tensors the online run's step s received: same losses, step for step. A run longer
than the cache reads it again from sample 0 (the anchored storages: pass p reads draw p mod K, NOTE [Anchor draws]
in analysis/capture.py).

NOTE [Atomic shards]: a shard is written to a temporary beside it, fsynced, renamed into place, and only then
recorded (with its sha256 and size) in manifest.json, itself replaced atomically. A kill at any point leaves
complete shards that the manifest records, and at most a temporary (removed on resume) or a renamed shard the
manifest does not record (written again). Resume verifies every recorded shard's size and sha256 and writes
again only the shards that are missing or differ."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..analysis.capture import (MANIFEST, Cut, anchor_draws, capture_bill, draw_name, redraw, storage_of, compare_signatures, entry_samples,
                                file_sha256, find_cut, json_safe, missing_samples, new_manifest, part_name,
                                rank_samples, read_manifest, refuse_unless_fits, samples_text, shard_name, shard_of,
                                shard_problem, signature, tensor_key, weights_files)
from ..analysis.launch import replicas
from ..errors import GraphError, Location, Problem
from .durable import fsync_dir, write_json_atomic
from ..ir.graph import Ref
from ..exec.devices import torch_devices
from ..exec.interpreter import Interpreter
from ..exec.models import ModelStore
from ..units import fmt_bytes
from .data import load_data
from .trainer import _set_threads, micro_generator


def target_weights_hash(typed, cut: Cut) -> dict[str, str | None]:
    """sha256 of each target-side model's weights files (None: randomly initialised)."""
    out: dict[str, str | None] = {}
    base = Path(typed.ctx.spec.file).parent if typed.ctx.spec.file else Path(".")
    for n in typed.graph.nodes:
        if not n.model or n.model in out or not set(typed.ctx.devices_of(n.device)) & set(cut.target_devices):
            continue
        w = typed.ctx.models[n.model].spec.weights
        if w is None:
            out[n.model] = None
            continue
        h = hashlib.sha256()
        for f in weights_files(base / w):
            h.update(f.name.encode())
            h.update(file_sha256(f).encode())
        out[n.model] = h.hexdigest()
    return out


def graph_signature(plan) -> dict[str, Any]:
    typed = plan.typed
    return json_safe(signature(typed, plan.rewritten, target_weights_hash(typed, find_cut(typed))))


def _refuse_other(directory: Path, differences: list[str], what: str) -> GraphError:
    shown = "\n    ".join(differences[:20]) + (f"\n    ... and {len(differences) - 20} more" if len(differences) > 20 else "")
    return GraphError(Problem(f"the cache in {directory} was captured from another graph: {len(differences)} "
                              f"difference(s) in its signature\n    {shown}", Location(str(directory / MANIFEST)),
                              hint=what))


def _eta(done: int, total: int, seconds: float) -> str:
    if done <= 0:
        return "?"
    left = seconds / done * (total - done)
    return f"{left:.0f} s" if left < 120 else f"{left / 60:.1f} min"


class _Recorder:
    """Stands in for exec/distributed.Comm on the target side: a transfer's send is a write (NOTE [The cut])."""

    def __init__(self):
        self.got: dict[str, torch.Tensor] = {}

    def send(self, x: torch.Tensor, route: str) -> None:
        self.got[route] = x.detach().to("cpu", copy=True).contiguous()   # its own storage (safetensors)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 storage: float8_e4m3fn values and one float32 scale per row (the last axis), scale = amax / 448 so the
    row's largest magnitude maps to fp8's largest finite value; an all-zero row gets scale 1."""
    from ..analysis.capture import FP8_MAX

    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """NOTE [Atomic shards]: the shard's sha256 and size once it is in place. No `__metadata__`: safetensors
    writes it in hash-map order, so the same shard would not be the same bytes twice (the manifest holds the
    shard's samples)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    os.chmod(tmp, 0o644)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = file_sha256(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest, size


class CacheWriter:
    """Shards of a cache, written in sample order (NOTE [Sample order]); resumable (NOTE [Atomic shards])."""

    def __init__(self, directory: Path, sig: dict[str, Any], samples: int, shard_samples: int, cut: Cut,
                 overwrite: bool = False, stored: frozenset[str] | None = None, rank: tuple[int, int, int] | None = None):
        """rank: (this target rank, its replica, the number of replicas) under torchrun (NOTE [One writer per
        target rank]): the writer then holds that replica's samples only, in shards named for the rank, and
        records them in the rank's part; the directory was prepared by the writer rank (prepare_directory)."""
        self.dir, self.cut, self.samples, self.shard_samples = directory, cut, samples, shard_samples
        self.fp8 = sig.get("storage") == "anchored-fp8"
        # storage "all": only the anchor-independent crossings that are not in the frontier, and the frontier
        self.stored = stored
        self.rank = rank
        self.mine = range(samples) if rank is None else rank_samples(samples, rank[1], rank[2])
        directory.mkdir(parents=True, exist_ok=True)
        self.kept: dict[int, dict] = {}
        self.rewritten: list[str] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.bytes_written = 0
        if rank is not None:
            self._open_part(sig)
            return
        if overwrite:
            for p in [*directory.glob("shard-*.safetensors"), directory / MANIFEST]:
                p.unlink(missing_ok=True)
        elif (directory / MANIFEST).exists():
            m = read_manifest(directory)
            diff = compare_signatures(m["signature"], sig)
            if m.get("replica_ranks"):
                diff.append(f"writers: the cache was written by target ranks {m['replica_ranks']} under torchrun, "
                            "this capture runs in one process")
            if m["samples"] != samples or m["shard_samples"] != shard_samples:
                diff.append(f"samples: the cache has {m['samples']} in shards of {m['shard_samples']}, this capture "
                            f"asks for {samples} in shards of {shard_samples}")
            if diff:
                raise _refuse_other(directory, diff, "capture into another --out, or add --overwrite to replace it")
            for e in m["shards"]:
                bad = shard_problem(directory, e)
                if bad is None:
                    self.kept[e["index"]] = e
                else:
                    self.rewritten.append(bad)
        elif any(directory.iterdir()):
            raise GraphError(Problem(f"{directory} is not empty and holds no cache ({MANIFEST})",
                                     Location(str(directory)), hint="capture into an empty or new directory, or add "
                                     "--overwrite to write over it"))
        for stale in directory.glob(".*.tmp*"):       # what a kill during a write left (the directory is a cache)
            stale.unlink(missing_ok=True)
        self.manifest = new_manifest(sig, samples, shard_samples)
        self.manifest["shards"] = sorted(self.kept.values(), key=lambda e: e["index"])
        self.record = directory / MANIFEST
        write_json_atomic(self.record, self.manifest)

    def _open_part(self, sig: dict[str, Any]) -> None:
        """This rank's shards from before (its part, else the merged manifest of a finished capture), verified;
        its own temporaries removed (NOTE [One writer per target rank])."""
        rank = self.rank[0]
        self.record = self.dir / part_name(rank)
        before = self.record if self.record.exists() else self.dir / MANIFEST
        if before.exists():
            m = json.loads(before.read_text())
            for e in m["shards"]:
                if e.get("rank") != rank:
                    continue
                bad = shard_problem(self.dir, e)
                if bad is None:
                    self.kept[e["index"]] = e
                else:
                    self.rewritten.append(bad)
        for stale in [*self.dir.glob(f".shard-r{rank}-*.tmp*"), *self.dir.glob(f".{part_name(rank)}.tmp*")]:
            stale.unlink(missing_ok=True)
        self.manifest = new_manifest(sig, self.samples, self.shard_samples)
        self.manifest["rank"] = rank
        self.manifest["shards"] = sorted(self.kept.values(), key=lambda e: e["index"])
        write_json_atomic(self.record, self.manifest)

    @property
    def shards(self) -> int:
        return -(-len(self.mine) // self.shard_samples)

    def shard_of(self, i: int) -> int:
        """The shard (of this writer) that holds sample i."""
        return self.mine.index(i) // self.shard_samples

    def shard_done(self, k: int) -> bool:
        return k in self.kept

    def add(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Sample i (its crossings by transfer node); a shard is written when its last sample arrives."""
        j = self.mine.index(i)
        k = j // self.shard_samples
        for node, t in tensors.items():
            if self.stored is not None and node not in self.stored:
                continue           # made again when read (NOTE [Storage choices])
            if self.fp8 and t.is_floating_point() and t.dim() > 0:
                q, scale = quantize(t)
                self.pending[tensor_key(i, node)] = q
                self.pending[tensor_key(i, node) + "#scale"] = scale
            else:
                self.pending[tensor_key(i, node)] = t
        last = min((k + 1) * self.shard_samples, len(self.mine)) - 1
        if j == last:
            first = k * self.shard_samples
            path = self.dir / shard_name(k, None if self.rank is None else self.rank[0])
            digest, size = _write_shard(path, self.pending)
            self.pending = {}
            self.bytes_written += size
            entry = {"index": k, "file": path.name, "first": self.mine[first], "samples": last + 1 - first,
                     "bytes": size, "sha256": digest}
            if self.rank is not None:
                entry.update(rank=self.rank[0], stride=self.mine.step)
            self.kept[k] = entry
            self.manifest["shards"] = sorted(self.kept.values(), key=lambda e: e["index"])
            write_json_atomic(self.record, self.manifest)

    @property
    def complete(self) -> bool:
        return len(self.kept) == self.shards


def stored_keys(typed) -> frozenset[str] | None:
    """What a shard holds per sample under the 'all' storage: the kept crossings and the frontier ('@node.output');
    None: every crossing (NOTE [Storage choices])."""
    if storage_of(typed.ctx.spec.capture) != "all":
        return None
    rd = redraw(typed)
    return frozenset([*(c.node for c in rd.kept), *("@" + r for r in rd.frontier)])


class TargetSide:
    """The graph's target side in this process: the corpus's replica shards, the target-side models, and the
    interpreter over the target devices only, whose transfers' sends are kept (_Recorder). `sample(i)` is sample
    i's crossings (NOTE [Sample order]); samples are produced in order, `advance()` moves the data past one without
    running anything."""

    def __init__(self, plan, cut: Cut, device_map=(), devices: tuple[str, ...] | None = None, samples: int = 0):
        """devices: the target devices of this rank under torchrun (default: every target device). samples: the
        cache's N, which places draw e of sample i at training sample e * N + i (NOTE [Anchor draws])."""
        typed = plan.typed
        spec = typed.ctx.spec
        self.tdev = torch_devices(spec, list(device_map))
        self.seed = int(spec.train["seed"])
        self.accum = int(spec.train.get("grad_accum") or 1)
        self.R = replicas(typed)
        base = Path(spec.data.get("_base", "."))
        vocab = next((int(m.dims.vocab_size) for m in typed.ctx.models.values() if m.spec.arch == "dflash"), None)
        seq = next(t.sizes[0] for r, t in typed.types.items() if r.output == "input_ids")
        train, _ = load_data(spec.data, base, seq, self.seed, vocab, spec.loc)
        self.shards = {r: train.shard(r, self.R) for r in range(self.R)}
        torch.manual_seed(self.seed)
        local = frozenset(cut.target_devices if devices is None else devices)
        self.store = ModelStore(typed, self.tdev, self.seed)
        self.store.preload(local)
        self.rec = _Recorder()
        self.interp = Interpreter(typed, self.store, self.tdev, seed=self.seed, track_memory=False, local=local,
                                  comm=self.rec)
        self.sends = {c.node: c.node for c in cut.crossings}
        # storage "all": the anchored subgraph's frontier is kept too (NOTE [Storage choices], analysis/capture.py);
        # K anchor draws: the frontier is kept for draws 1..K-1 (NOTE [Anchor draws])
        self.all = storage_of(spec.capture) == "all"
        self.draws, self.N = anchor_draws(typed), samples
        self.redrawer = Redrawer(plan, f"capture with [capture] anchor_draws = {self.draws}") \
            if self.draws > 1 else None
        self.redraw = redraw(typed) if self.all or self.redrawer else None
        self.keep = frozenset(Ref.parse(r) for r in self.redraw.frontier) if self.redraw else frozenset()
        self.forwards = 0
        self.next = 0


    def _where(self, i: int) -> tuple[int, int, int]:
        step, rest = divmod(i, self.accum * self.R)
        a, r = divmod(rest, self.R)
        return step, a, r

    def sample(self) -> dict[str, torch.Tensor]:
        """Sample i's crossings by transfer node (draw 0), draws 1..K-1 of its anchored crossings under their draw
        names (NOTE [Anchor draws]), and with the 'all' storage its frontier under '@node.output'."""
        i = self.next
        step, a, r = self._where(i)
        self.rec.got = {}
        res = self.interp.run_replica(r, lambda rr: self.shards[rr].next_batch(), keep=self.keep,
                                      generator=micro_generator(self.seed, self.accum, step, a, r), sends=self.sends)
        self.forwards += 1
        self.next += 1
        got = dict(self.rec.got)
        frontier = {ref: res[ref.node][ref.output].detach().to("cpu", copy=True).contiguous() for ref in self.keep}
        if self.all:
            got.update({"@" + str(ref): t for ref, t in frontier.items()})
        for e in range(1, self.draws):
            for node, t in self.redrawer.anchored(frontier, e * self.N + i).items():
                got[draw_name(node, e)] = t.contiguous()
        return got

    def advance(self) -> None:
        self.shards[self._where(self.next)[2]].next_batch()   # the data position moves on; nothing is run
        self.next += 1

    def pass_over(self) -> None:
        """Past a sample of a replica another rank runs (its data is that replica's shard: untouched here)."""
        self.next += 1


def _fitting_bill(plan, out: Path, samples: int | None, kept_bytes: int = 0):
    """The bill for `samples` (default: the graph's), refused when the cache does not fit (what is already on disk
    of it stays, so it counts as free)."""
    import attrs

    bill = capture_bill(plan, out)
    if samples is not None:
        bill = attrs.evolve(bill, samples=samples,
                            storages=tuple(attrs.evolve(s, total=s.per_sample * samples) for s in bill.storages))
    if bill.disk_bytes is not None and bill.disk_from.startswith("free space"):
        bill = attrs.evolve(bill, disk_bytes=bill.disk_bytes + kept_bytes)
    refuse_unless_fits(bill, Location(flag=f"--out {out}"))
    return bill


def _write_share(plan, cut: Cut, writer: CacheWriter, out: Path, device_map=(), devices: tuple[str, ...] | None = None,
                 progress: bool = True, stream=None, kept_bytes: int = 0, check=None) -> dict[str, Any]:
    """The capture loop, for one writer: in one process every sample of the cache (`writer.rank` None), under
    torchrun the samples of this target rank's replica (NOTE [One writer per target rank]), the other replicas'
    passed over. Samples in shards kept from before move the data on without running the target side; the rest
    are run and written, with a progress line after each shard. `devices`: this rank's target devices (default:
    every target device). `check(i)` before each sample (under torchrun: raises when the run must stop, a rank
    lost or Ctrl-C). Returns what this writer did."""
    spec = plan.typed.ctx.spec
    N = writer.samples
    who = "" if writer.rank is None else f"rank {writer.rank[0]}: "
    _set_threads(int(spec.train.get("threads", 0)), torch_devices(spec, list(device_map)))
    side = TargetSide(plan, cut, device_map, devices=devices, samples=N)
    t0 = time.perf_counter()          # the target side is built: what follows is the capture itself
    mine = writer.mine
    todo = sum(1 for i in mine if not writer.shard_done(writer.shard_of(i)))
    if progress and writer.kept:
        print(f"capture: {who}resuming in {out}: {len(writer.kept)} of {writer.shards} "
              f"{'' if writer.rank is None else 'of its '}shards complete and verified", file=stream, flush=True)
    for bad in writer.rewritten:
        print(f"warning: {who}writing again {bad}", file=stream, flush=True)
    done = 0
    for i in range(N):
        if i not in mine:               # another rank's replica (its data shard is untouched here)
            side.pass_over()
            continue
        k = writer.shard_of(i)
        if writer.shard_done(k):
            side.advance()
            continue
        if check is not None:
            check(i)
        writer.add(i, side.sample())
        done += 1
        j = mine.index(i)
        if progress and ((j + 1) % writer.shard_samples == 0 or j == len(mine) - 1):
            el = time.perf_counter() - t0
            rate = f"{done / max(el, 1e-9):.1f} samples/s, ETA {_eta(done, todo, el)}"
            if writer.rank is None:
                line = (f"capture: {j + 1}/{N} samples, shard {k + 1}/{writer.shards}, "
                        f"{fmt_bytes(writer.bytes_written + kept_bytes)} on disk, {rate}")
            else:
                line = (f"capture: rank {writer.rank[0]} (1 of {writer.rank[2]} target ranks): {j + 1}/{len(mine)} of "
                        f"its samples ({N} in all), shard {k + 1}/{writer.shards}, {fmt_bytes(writer.bytes_written)} "
                        f"written, {rate}")
            print(line, file=stream, flush=True)
    return {"forwards": side.forwards, "written": writer.bytes_written, "seconds": time.perf_counter() - t0}


def capture(plan, out: Path, samples: int | None = None, overwrite: bool = False, progress: bool = True,
            device_map=(), stream=None) -> dict[str, Any]:
    """Run the target side over the corpus and write the cache (NOTE [Sample order], NOTE [Atomic shards]): the
    capture of one target rank (_write_share) that runs every replica and records its shards in manifest.json.
    Returns what was done: samples run, shards written and kept, bytes, seconds, target forwards."""
    stream = sys.stderr if stream is None else stream
    typed = plan.typed
    spec = typed.ctx.spec
    cut = find_cut(typed)
    N = samples if samples is not None else capture_bill(plan, out).samples
    _fitting_bill(plan, out, N)       # before anything is written or built
    shard_samples = int(spec.capture.get("shard_samples") or 64)
    writer = CacheWriter(out, graph_signature(plan), N, shard_samples, cut, overwrite, stored_keys(typed))
    kept_bytes = sum(e["bytes"] for e in writer.kept.values())
    kept_before = len(writer.kept)
    bill = _fitting_bill(plan, out, N, kept_bytes)
    st = _write_share(plan, cut, writer, out, device_map, progress=progress, stream=stream, kept_bytes=kept_bytes)
    return {"samples": N, "shards": writer.shards, "kept": kept_before,
            "written_bytes": st["written"], "bytes": sum(e["bytes"] for e in writer.kept.values()),
            "seconds": st["seconds"], "target_forwards": st["forwards"], "predicted_bytes": bill.default.total,
            "rewritten": writer.rewritten}


def check_rank_directory(out: Path, sig: dict[str, Any], samples: int, shard_samples: int, ranks: list[int],
                         overwrite: bool) -> int:
    """What a capture under torchrun finds in --out, read only (every rank reaches the same verdict before the
    process group exists): a cache of another graph, samples, shards or target ranks refused; a directory that
    holds something else refused. Returns the bytes of the shards already there (they count as free space)."""
    if overwrite or not out.exists():
        return 0
    records = [out / MANIFEST] if (out / MANIFEST).exists() else sorted(out.glob("manifest-r*.json"))
    if not records:
        if any(out.iterdir()):
            raise GraphError(Problem(f"{out} is not empty and holds no cache ({MANIFEST})", Location(str(out)),
                                     hint="capture into an empty or new directory, or add --overwrite to write over it"))
        return 0
    for rec in records:
        m = read_manifest(out) if rec.name == MANIFEST else json.loads(rec.read_text())
        diff = compare_signatures(m["signature"], sig)
        if rec.name == MANIFEST and m.get("replica_ranks") != ranks:
            diff.append(f"writers: the cache was written by {'target ranks ' + str(m['replica_ranks']) if m.get('replica_ranks') else 'one process'}, "
                        f"this capture by target ranks {ranks}")
        if m["samples"] != samples or m["shard_samples"] != shard_samples:
            diff.append(f"samples: the cache has {m['samples']} in shards of {m['shard_samples']}, this capture "
                        f"asks for {samples} in shards of {shard_samples}")
        if diff:
            raise _refuse_other(out, diff, "capture into another --out, or add --overwrite to replace it")
    return sum(p.stat().st_size for p in out.glob("shard-r*.safetensors"))


def capture_ranks(plan, out: Path, samples: int | None = None, overwrite: bool = False, progress: bool = True,
                  device_map=(), stream=None, stage: dict | None = None) -> dict[str, Any] | None:
    """`capture` under torchrun, on every rank (NOTE [One writer per target rank]): each target rank runs its
    replica's samples and writes its own shards; the writer rank (the lowest target rank) shows the progress of
    its own share, gathers every rank's shards and writes manifest.json once. A rank without a target device (the
    drafter's) only takes part in the gather. Returns, on the writer rank, what was done over all ranks (None on
    the others). `stage["shared"]` is True until the process group exists (every rank's verdict is the same)."""
    from ..analysis.capture import merge_parts, replica_ranks
    from ..analysis.launch import analyze_launch
    from ..exec.distributed import Comm, gather_watching_all

    stream = sys.stderr if stream is None else stream
    stage = {} if stage is None else stage
    typed = plan.typed
    spec = typed.ctx.spec
    cut = find_cut(typed)
    ranks = replica_ranks(typed, cut)
    R = len(ranks)
    N = samples if samples is not None else capture_bill(plan, out).samples
    shard_samples = int(spec.capture.get("shard_samples") or 64)
    sig = graph_signature(plan)
    kept_bytes = check_rank_directory(out, sig, N, shard_samples, ranks, overwrite)
    bill = _fitting_bill(plan, out, N, kept_bytes)      # before anything is written or built
    rank = int(os.environ["RANK"])
    writer_rank = min(ranks)
    accum = int(spec.train.get("grad_accum") or 1)
    # the ranks exchange only Python objects (the shards' entries), on the control group; every wait is watched
    # by the heartbeats (exec/distributed.py): a rank lost while the others wait is named, and stops them
    launch = analyze_launch(typed)
    by_rank = {k: launch.rank_devices(k) for k in range(launch.world_size)}
    tdev = torch_devices(spec, list(device_map), only=by_rank[rank])
    comm = Comm(launch, by_rank, spec.launch.stall_timeout, lambda d: tdev[d])
    stage["shared"] = False
    if rank == writer_rank:
        if overwrite:
            for p in [*out.glob("shard-*.safetensors"), *out.glob("manifest*.json")]:
                p.unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
    comm.broadcast(None, writer_rank, f"the writer rank's preparing of {out}")
    mine: list[dict] = []
    stats = {"rank": rank, "forwards": 0, "written": 0, "kept": 0, "rewritten": [], "shards": 0, "seconds": 0.0}
    if rank in ranks:
        q = ranks.index(rank)
        writer = CacheWriter(out, sig, N, shard_samples, cut, stored=stored_keys(typed), rank=(rank, q, R))
        stats["kept"], stats["rewritten"], stats["shards"] = len(writer.kept), writer.rewritten, writer.shards
        from ..analysis.launch import device_for

        devs = tuple(sorted({device_for(typed, n.device, q) for n in typed.graph.nodes
                             if set(typed.ctx.devices_of(n.device)) & set(cut.target_devices)}))
        # the writer rank shows the progress of its own share
        share = _write_share(plan, cut, writer, out, device_map, devices=devs,
                             progress=progress and rank == writer_rank, stream=stream,
                             check=lambda i: comm.set_where(i // (accum * R), f"capture of sample {i}", q))
        mine = list(writer.kept.values())
        stats.update(forwards=share["forwards"], written=share["written"], seconds=share["seconds"])
    comm.set_where((N - 1) // (accum * R), "the gather of every rank's shards", None)
    got = gather_watching_all(comm, (mine, stats), writer_rank, "the gather of every rank's shards")
    result = None
    if rank == writer_rank:
        parts = {st["rank"]: es for es, st in got if st["rank"] in ranks}
        m = merge_parts(sig, N, shard_samples, ranks, parts)
        write_json_atomic(out / MANIFEST, m)         # once, atomically, after every rank's last shard
        for r in ranks:
            (out / part_name(r)).unlink(missing_ok=True)
        fsync_dir(out)
        st = [s for _, s in got if s["rank"] in ranks]
        result = {"samples": N, "shards": sum(s["shards"] for s in st), "kept": sum(s["kept"] for s in st),
                  "written_bytes": sum(s["written"] for s in st), "bytes": sum(e["bytes"] for e in m["shards"]),
                  "seconds": max(s["seconds"] for s in st), "target_forwards": sum(s["forwards"] for s in st),
                  "predicted_bytes": bill.default.total, "rewritten": [b for s in st for b in s["rewritten"]],
                  "ranks": ranks}
    comm.broadcast(None, writer_rank, "the end of the capture")   # every rank ends once the manifest is in place
    comm.close()
    return result


def _drafter_side_devices(plan, device_map=()) -> dict[str, str]:
    """Each transfer's torch device on the drafter side (its output lives there)."""
    tdev = torch_devices(plan.typed.ctx.spec, list(device_map))
    nodes = {c.node for c in find_cut(plan.typed).crossings}
    return {n.id: tdev[plan.typed.ctx.devices_of(n.device)[0]] for n in plan.typed.graph.nodes if n.id in nodes}


# -- reading ---------------------------------------------------------------------------------------------------

def _as_is(item):
    """The loader's collate function: a shard's tensors as read (a module-level function: spawn pickles it)."""
    return item


class _Shards(torch.utils.data.Dataset):
    """One item per shard: its tensors, read and checked against the manifest in a loader worker; a shard that
    is missing or differs comes back as the reason (the main process decides what to do with it)."""

    def __init__(self, directory: Path, entries: list[dict]):
        self.dir, self.entries = directory, entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, k: int):
        from safetensors.torch import load

        e = self.entries[k]
        path = self.dir / e["file"]
        try:
            data = path.read_bytes()
        except OSError as err:
            return k, f"{path}: cannot be read ({err.strerror or err})"
        if len(data) != e["bytes"]:
            return k, f"{path}: {len(data):,} bytes, the manifest records {e['bytes']:,}"
        digest = hashlib.sha256(data).hexdigest()
        if digest != e["sha256"]:
            return k, f"{path}: sha256 {digest[:16]}..., the manifest records {e['sha256'][:16]}..."
        return k, load(data)


class Redrawer:
    """The anchored crossings drawn again from the frontier of the nodes that make them (analysis/capture.redraw),
    with the generator of a given training sample, on CPU. NOTE [Storage choices], "all": the crossings of one
    sample from what the cache stores: the kept crossings as they are, the anchored ones drawn for the training
    sample being fed (so each pass draws its own anchors, and the first pass draws the online run's). NOTE
    [Anchor draws]: capture's draws 1..K-1 of a sample."""

    def __init__(self, plan, what: str = "the 'all' storage"):
        typed = plan.typed
        spec = typed.ctx.spec
        self.typed, self.rd, self.cut = typed, redraw(typed, what), find_cut(typed)
        interp = Interpreter(typed, None, {d: "cpu" for d in spec.devices}, track_memory=False, local=frozenset())
        self.impls, self.params = interp.impls, interp.params
        self.seed, self.accum, self.R = int(spec.train["seed"]), int(spec.train.get("grad_accum") or 1), replicas(typed)

    def run(self, frontier: dict[Ref, torch.Tensor], j: int) -> dict[Ref, torch.Tensor]:
        """The frontier and every output of the redrawn nodes, as training sample j draws them."""
        from ..exec.interpreter import ExecContext

        step, rest = divmod(j, self.accum * self.R)
        a, r = divmod(rest, self.R)
        gen = micro_generator(self.seed, self.accum, step, a, r)
        env = dict(frontier)
        g = self.typed.graph
        with torch.no_grad():
            for nid in self.rd.nodes:
                n = g[nid]
                ctx = ExecContext(n, self.params[nid], torch.device("cpu"), n.device, r,
                                  frozenset(self.typed.outputs_of(nid)), gen, None, None)
                for k, v in self.impls[nid](ctx, **{p: env[ref] for p, ref in n.inputs}).items():
                    env[Ref(nid, k)] = v
        return env

    def anchored(self, frontier: dict[Ref, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
        """The anchored crossings, by transfer node, that training sample j draws from this frontier."""
        env = self.run(frontier, j)
        return {c.node: env[Ref.parse(c.source)] for c in self.cut.crossings if c.anchored}

    def __call__(self, stored: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
        env = self.run({Ref.parse(k[1:]): v for k, v in stored.items() if k.startswith("@")}, j)
        return {c.node: stored[c.node] if c.node in stored else env[Ref.parse(c.source)] for c in self.cut.crossings}


def _sample(tensors: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Sample i's tensors in a shard, by their name after the sample's prefix."""
    prefix = tensor_key(i, "")
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _stored(tensors: dict[str, torch.Tensor], i: int, c, draw: int = 0) -> torch.Tensor:
    """Crossing c of sample i as the drafter side receives it (fp8 storage dequantized to the crossing's dtype);
    an anchored crossing's draw `draw` (NOTE [Anchor draws])."""
    key = tensor_key(i, draw_name(c.node, draw if c.anchored else 0))
    scale = tensors.get(key + "#scale")
    if scale is None:
        return tensors[key]
    return dequantize(tensors[key], scale, getattr(torch, c.dtype))


def _capture_command(plan, m: dict) -> str:
    """The command that wrote (and finishes) a cache: a launch when target ranks wrote it."""
    if not m.get("replica_ranks"):
        return "dflash-graph capture"
    from ..analysis.launch import analyze_launch

    return f"dflash-graph launch --nproc-per-node {analyze_launch(plan.typed).world_size} capture"


class CacheSource:
    """Where the drafter side's inputs come from in `run --hidden-states DIR`: the cache's samples in order, as
    the receives of the drafter side's transfers (NOTE [Sample order]). `own_replicas`: under torchrun, the replica
    indices this drafter rank trains (NOTE [From disk under torchrun], analysis/from_disk.py): it reads only the
    samples i with i % R among them, in order, and only the shards that hold one."""

    def __init__(self, plan, directory: Path, on_bad_shard: str = "stop", workers: int = 1, prefetch: int = 2,
                 sig: dict[str, Any] | None = None, device_map=(), own_replicas: frozenset[int] | None = None):
        self.dir = directory
        self.R = replicas(plan.typed)
        self.mine = (None if own_replicas is None or set(own_replicas) >= set(range(self.R))
                     else frozenset(own_replicas))
        self._device = _drafter_side_devices(plan, device_map)
        self.redrawer = Redrawer(plan) if storage_of(plan.typed.ctx.spec.capture) == "all" else None
        m = read_manifest(directory)
        sig = graph_signature(plan) if sig is None else sig
        diff = compare_signatures(m["signature"], sig)
        if diff:
            raise _refuse_other(directory, diff, f"capture this graph: dflash-graph capture {plan.typed.ctx.spec.file} "
                                                 "--out ANOTHER_DIR, then run --hidden-states ANOTHER_DIR")
        self.cut = find_cut(plan.typed)
        self.samples_total = int(m["samples"])
        self.draws = anchor_draws(plan.typed)       # the signature holds it: the cache's K is the graph's
        # in sample order; from several target ranks, interleaved (NOTE [One writer per target rank])
        entries = sorted(m["shards"], key=lambda e: e["first"])
        missing = missing_samples(m)
        if missing:
            raise GraphError(Problem(f"the cache in {directory} is incomplete: {len(missing)} of {self.samples_total} "
                                     f"samples were never written (first: sample {missing[0]}, in "
                                     f"{shard_of(m, missing[0])})", Location(str(directory / MANIFEST)),
                                     hint=f"finish it: {_capture_command(plan, m)} {plan.typed.ctx.spec.file} --out "
                                          f"{directory} (writes only what is missing)"))
        self.entries = [e for e in entries if any(self._wanted(i) for i in entry_samples(e))]
        self.on_bad = on_bad_shard
        self.workers, self.prefetch = workers, prefetch
        self.skipped_samples = 0
        self.bad: list[str] = []
        self.read = 0
        self.delivered = 0
        self.passes = 0
        self._it = None
        self._buf: dict[int, dict[str, torch.Tensor]] = {}    # read, by sample; at most one shard per writer
        self._gone: set[int] = set()        # samples of this pass in bad shards that were skipped
        self._pos = 0                       # the next sample of this pass

    @property
    def drafter_devices(self) -> tuple[str, ...]:
        return self.cut.drafter_devices

    def _wanted(self, i: int) -> bool:
        return self.mine is None or i % self.R in self.mine

    def loader_memory(self):
        """The host memory this reader holds at most: shards of the cache's largest in flight (NOTE [From-disk
        memory], analysis/from_disk.py)."""
        from ..analysis.from_disk import LoaderMemory

        return LoaderMemory(max((int(e["bytes"]) for e in self.entries), default=0), self.workers,
                            self.prefetch if self.workers > 0 else 0)

    def _loader(self):
        kw = {"num_workers": self.workers}
        if self.workers > 0:
            kw["prefetch_factor"] = self.prefetch
        return iter(torch.utils.data.DataLoader(_Shards(self.dir, self.entries), batch_size=None, shuffle=False,
                                                collate_fn=_as_is, **kw))

    def _fill(self) -> int:
        """Read shards until this pass's next sample is at hand (or skipped); returns that sample's index."""
        while True:
            if self._pos >= self.samples_total:        # the pass is over: the next one starts at sample 0
                self._pos, self._gone = 0, set()
                self._buf.clear()
                self.passes += 1
                if self.read == 0:
                    raise GraphError(Problem(f"no shard of the cache in {self.dir} could be read: "
                                             + "; ".join(self.bad[-3:]), Location(str(self.dir / MANIFEST)),
                                             hint=f"capture again: dflash-graph capture GRAPH --out {self.dir}"))
                if self._it is not None:
                    self.close()
            if self._pos in self._buf:
                return self._pos
            if self._pos in self._gone or not self._wanted(self._pos):
                self._pos += 1
                continue
            if self._it is None:
                self._it = self._loader()
            k, got = next(self._it)
            e = self.entries[k]
            if isinstance(got, str):
                if self.on_bad == "stop":
                    raise GraphError(Problem(f"shard {e['file']} of the cache ({samples_text(e)}) is bad: {got}",
                                             Location(str(self.dir / e['file'])),
                                             hint=f"write it again (only the bad shards are rewritten): dflash-graph "
                                                  f"capture GRAPH --out {self.dir}; or run with --on-bad-shard skip "
                                                  "to train on the others"))
                self.bad.append(got)
                self.skipped_samples += e["samples"]
                self._gone.update(entry_samples(e))
                print(f"warning: skipped {e['samples']} samples: {got} (--on-bad-shard skip; "
                      f"{self.skipped_samples} skipped so far)", file=sys.stderr, flush=True)
                continue
            self.read += 1
            draw = self.passes % self.draws          # pass p reads draw p mod K (NOTE [Anchor draws])
            for i in entry_samples(e):
                if not self._wanted(i):
                    continue
                if self.redrawer is not None:
                    self._buf[i] = _sample(got, i)
                else:
                    self._buf[i] = {c.node: _stored(got, i, c, draw) for c in self.cut.crossings}

    def next_inbox(self) -> dict[str, torch.Tensor]:
        """The next sample's crossings, by transfer node: what the drafter side's transfers receive."""
        i = self._fill()
        got = self._buf.pop(i)
        self._pos += 1
        if self.redrawer is not None:         # the anchors of training sample p * N + i (pass p)
            got = self.redrawer(got, self.passes * self.samples_total + i)
        self.delivered += 1
        return {n: t.to(self._device[n]) for n, t in got.items()}

    def summary(self) -> str:
        return (f"hidden states: {self.delivered} samples read from {self.dir} (0 target forwards)"
                + (f"; {self.skipped_samples} samples skipped in {len(self.bad)} bad shard(s)" if self.bad else ""))

    def close(self) -> None:
        """Stop the loader's workers now (not whenever the iterator is collected)."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    def skip(self, n: int) -> None:
        """Past the first n samples of the run, of every replica (what --resume does: its checkpoint's step, in
        samples): into pass n // N, whose draw the next samples are (NOTE [Anchor draws]); this reader delivers its
        own among them."""
        passes, n = divmod(n, self.samples_total)
        self.passes += passes
        for _ in range(sum(1 for i in range(n) if self._wanted(i))):
            self.next_inbox()


class HybridSource:
    """run --hidden-states DIR --hybrid: the first pass over the cache's samples runs the target side here and
    writes each sample as it trains on it (so epoch 0 is the online run), later passes read the cache
    (CacheSource). A cache already complete is only read; one left incomplete by a stopped run is continued
    (its complete shards are read, not run again)."""

    def __init__(self, plan, directory: Path, samples: int | None = None, on_bad_shard: str = "stop",
                 workers: int = 1, prefetch: int = 2, device_map=()):
        self.plan, self.dir, self.device_map = plan, directory, device_map
        self.opts = (on_bad_shard, workers, prefetch)
        spec = plan.typed.ctx.spec
        self.cut = find_cut(plan.typed)
        self.sig = graph_signature(plan)
        self.N = samples if samples is not None else capture_bill(plan, directory).samples
        self.reader: CacheSource | None = None
        self.writer: CacheWriter | None = None
        self.side: TargetSide | None = None
        complete = False
        if (directory / MANIFEST).exists():
            m = read_manifest(directory)
            complete = (not compare_signatures(m["signature"], self.sig) and m["samples"] == self.N and
                        not missing_samples(m))
        if complete:
            self.reader = CacheSource(plan, directory, *self.opts, sig=self.sig, device_map=device_map)
        else:
            _fitting_bill(plan, directory, self.N)
            self.writer = CacheWriter(directory, self.sig, self.N, int(spec.capture.get("shard_samples") or 64),
                                      self.cut, stored=stored_keys(plan.typed))
            self.side = TargetSide(plan, self.cut, device_map, samples=self.N)
            self._device = _drafter_side_devices(plan, device_map)
        self.i = 0
        self._forwards = 0
        self._read_from = 0
        self._shard: tuple[int, dict] | None = None

    @property
    def drafter_devices(self) -> tuple[str, ...]:
        return self.cut.drafter_devices

    @property
    def target_forwards(self) -> int:
        return self.side.forwards if self.side is not None else self._forwards

    def summary(self) -> str:
        read = self.reader.delivered - self._read_from if self.reader is not None else 0
        return (f"hidden states (hybrid): {self.target_forwards} target forwards captured into {self.dir}, "
                f"{read} samples read from it" + (f"; {self.reader.skipped_samples} skipped (bad shards)"
                                                  if self.reader is not None and self.reader.skipped_samples else ""))

    def _kept_sample(self, k: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if self._shard is None or self._shard[0] != k:
            self._shard = (k, load_file(str(self.dir / self.writer.kept[k]["file"])))
        if storage_of(self.plan.typed.ctx.spec.capture) == "all":
            return Redrawer(self.plan)(_sample(self._shard[1], self.i), self.i)
        return {c.node: _stored(self._shard[1], self.i, c) for c in self.cut.crossings}

    def next_inbox(self) -> dict[str, torch.Tensor]:
        if self.reader is None and self.i >= self.N:        # the cache is complete: from now on, read it
            self.reader = CacheSource(self.plan, self.dir, *self.opts, sig=self.sig, device_map=self.device_map)
            self.reader.delivered = self._read_from = self.i
            self.reader.passes = self.i // self.N     # pass 1: its draw, and 'all''s anchors (NOTE [Anchor draws])
            self._forwards = self.side.forwards
            self.side = None              # the target side's models are no longer needed
        if self.reader is not None:
            return self.reader.next_inbox()
        k = self.i // self.writer.shard_samples
        if self.writer.shard_done(k):
            got = self._kept_sample(k)
            self.side.advance()
        else:
            got = self.side.sample()
            self.writer.add(self.i, got)
        self.i += 1
        return {c.node: got[c.node].to(self._device[c.node]) for c in self.cut.crossings}

    def skip(self, n: int) -> None:
        for _ in range(n):
            self.next_inbox()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
