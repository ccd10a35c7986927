"""Checkpoints that survive a crash: drafter weights in safetensors, optimizer + scheduler + RNG + fp32 masters in a
torch file read with `weights_only=True` (tensors and plain containers only: a checkpoint directory cannot run
code), the step and data position in state.json, and a manifest with each file's size and SHA-256.

Layout of a run directory:

    checkpoints/step-00000050/   one directory per saved step; the last `keep` are kept
    checkpoint -> checkpoints/step-00000100   the newest, a symlink (what messages and tools name)

NOTE [Atomic checkpoints]: a step is written into `checkpoints/.tmp-step-N-PID`, every file fsynced, the manifest
last, then renamed to `step-N` (an atomic rename on one filesystem) and the directory fsynced; only then is the
`checkpoint` link replaced (os.replace of a fresh link, also atomic) and older steps pruned. At every instant the
newest complete step is on disk under its final name, so a SIGKILL anywhere leaves a good checkpoint, and a
leftover temporary is deleted by the next save. `load` does not trust the link: it verifies steps newest first
against their manifests and falls back to the newest one that verifies, naming each one it skipped.

A save that fails (a full disk, a directory made unwritable: an OSError, also for what safetensors reports in its
own exception type) deletes its temporary and re-raises; the previous steps are untouched. A save of weights or
fp32 masters that hold a NaN or an infinity is refused before anything is written (`NonFiniteWeights`).

NOTE [Save hook]: for tests only, and inert unless the environment sets DFLASH_GRAPH_SAVE_HOOK. Its value is `FD`,
`FD:STEP:POINT` or `FD:STEP:+SECONDS`: save() writes a line `STEP POINT MONOTONIC-TIME` to the open file descriptor
FD at each point of SAVE_POINTS it reaches; in the save of step STEP it stops for good at POINT (sleeps until it
is killed), or SIGKILLs its own process SECONDS after the save began (a random moment, wherever the save then is:
a timer in the process itself, so the moment does not depend on how fast another process reacts). The kill test
(tests/test_checkpoints.py) SIGKILLs whole runs both ways.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .durable import fsync_dir, fsync_file

FORMAT = "dflash-graph checkpoint 2"
_STEP_RE = re.compile(r"^step-(\d+)$")
HOOK_ENV = "DFLASH_GRAPH_SAVE_HOOK"
# the points of a save, in order (NOTE [Save hook])
SAVE_POINTS = ("begin", "tmp-created", "weights-written", "trainer-written", "state-written", "manifest-written",
               "renamed", "link-made", "linked", "pruned")


def _reached(point: str, step: int) -> None:
    hook = os.environ.get(HOOK_ENV)
    if not hook:
        return
    fd, _, stop = hook.partition(":")
    os.write(int(fd), f"{step} {point} {time.monotonic():.6f}\n".encode())
    at, _, what = stop.partition(":")
    if at != str(step):
        return
    if what == point:
        while True:
            time.sleep(60)
    if what.startswith("+") and point == "begin":
        import signal
        import threading

        threading.Timer(float(what[1:]), os.kill, (os.getpid(), signal.SIGKILL)).start()


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def clean_temporaries(dirpath: Path) -> list[Path]:
    """Delete what an interrupted save left behind: `checkpoints/.tmp-*` and the older format's
    `.checkpoint.tmp*` (never `.checkpoint.old`, which may be an older run's only complete checkpoint)."""
    removed = []
    for p in [*(dirpath / "checkpoints").glob(".tmp-*"), *dirpath.glob(".checkpoint.tmp*"), *dirpath.glob(".checkpoint.lnk*")]:
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


class NonFiniteWeights(ValueError):
    """A tensor about to be checkpointed holds a NaN or an infinity; nothing was written."""


def _local(v: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (FSDP2 DTensor) tensor; any other tensor as it is."""
    return v.to_local() if hasattr(v, "to_local") else v


def _like(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor laid out as the live tensor `p`: this rank's shard of it where `p` is a DTensor (a
    sharded drafter, NOTE [Sharded drafter] in train/trainer.py; cut locally, no collective), else `v`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor) and not isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
        return distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    return v


def nonfinite_tensors(drafters, masters=()) -> list[str]:
    """Names of the drafters' parameters and buffers (and fp32 masters) that hold a NaN or an infinity. `drafters`:
    modules, or their whole state dicts (a sharded drafter's, gathered); a sharded master: this rank's shard."""
    bad = []
    for name, m in drafters.items():
        for k, v in (m if isinstance(m, dict) else m.state_dict()).items():
            if v.is_floating_point() and not bool(torch.isfinite(_local(v)).all()):
                bad.append(f"{name}.{k}")
    for i, v in enumerate(masters):
        if v.is_floating_point() and not bool(torch.isfinite(_local(v.detach())).all()):
            bad.append(f"fp32 master {i}")
    return bad


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file; its I/O failures (its own exception type) as the OSError they are."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:
        m = re.search(r"os error (\d+)", str(e))
        if m is None or isinstance(e, OSError):
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


# NOTE [Sharded checkpoints]: a data-parallel drafter (`parallel` on the model, under torchrun) saves its fp32
# masters and AdamW state through torch.distributed.checkpoint (DCP), every drafter rank together
# (`save_sharded`, into checkpoints/.dcp-step-N): each tensor is saved under the parameter's name
# ("drafter.layers.0.mlp.up_proj.weight"), not its position in one optimizer, and DCP's planner has each replicated
# tensor written once, by one of the ranks. The writer then moves that directory into the step as `drafter.dcp`
# (its files in the manifest like any other) and writes the rest as usual: the drafter's whole weights in
# safetensors (export and evaluate read them), the scheduler and generators in trainer.pt, without the optimizer.
# `restore` loads `drafter.dcp` with DCP on whatever ranks the resuming graph trains on (one process, one rank,
# or another number of drafter ranks): DCP reshards by name, so N drafter ranks resume on M. A checkpoint without
# it (one rank's, or the writer's alone when a rank was lost, when no collective can run) holds the whole
# optimizer in trainer.pt and resumes on any number of ranks the same way, each loading all of it.
DCP_DIR = "drafter.dcp"
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def param_names(drafters: dict[str, torch.nn.Module]) -> list[str]:
    """The trainable parameters' names, in the order of ModelStore.trainable_parameters (and of the masters)."""
    return [f"{name}.{k}" for name, m in drafters.items() for k, p in m.named_parameters() if p.requires_grad]


def _sharded_state(drafters, optimizer, masters, init: bool) -> dict[str, dict[str, torch.Tensor]]:
    """{"masters": {name: fp32 master}, "step"/"exp_avg"/"exp_avg_sq": {name: AdamW state}}: detached views of
    the live tensors, which DCP reads from on save and writes into on load (`init`: AdamW state made first, as the
    optimizer's first step would make it, so that there is something to load into)."""
    names = param_names(drafters)
    out: dict[str, dict[str, torch.Tensor]] = {"masters": {}, **{k: {} for k in ADAM_KEYS}}
    for name, m in zip(names, masters):
        st = optimizer.state[m]
        if init and not st:
            st.update({"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m, memory_format=torch.preserve_format),
                       "exp_avg_sq": torch.zeros_like(m, memory_format=torch.preserve_format)})
        out["masters"][name] = m.detach()
        for k in ADAM_KEYS:
            if k in st:
                out[k][name] = st[k].detach() if torch.is_tensor(st[k]) else torch.tensor(float(st[k]))
    return out


def save_sharded(dirpath: Path, step: int, drafters, optimizer, masters, group) -> Path:
    """Every drafter rank: the masters and AdamW state through DCP into checkpoints/.dcp-step-N (NOTE [Sharded
    checkpoints]); returns that directory, which the writer's `save(..., sharded=...)` takes into the step."""
    import torch.distributed.checkpoint as dcp

    bad = nonfinite_tensors({}, masters)
    if bad:
        raise NonFiniteWeights(f"refusing to save the checkpoint of step {step}: {len(bad)} tensor(s) hold NaN or "
                               f"infinite values ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    where = dirpath / "checkpoints" / f".dcp-step-{step:08d}"     # the writer removed what a killed save left
    where.mkdir(parents=True, exist_ok=True)
    dcp.save(_sharded_state(drafters, optimizer, masters, init=False), checkpoint_id=str(where), process_group=group)
    return where


def _restore_sharded(ck: Path, drafters, optimizer, masters, params, group) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    state = _sharded_state(drafters, optimizer, masters, init=True)
    no_dist = group is None
    if no_dist and dist.is_initialized():
        dcp.load(state, checkpoint_id=str(ck / DCP_DIR), no_dist=True)
    elif no_dist:
        dcp.load(state, checkpoint_id=str(ck / DCP_DIR))
    else:
        dcp.load(state, checkpoint_id=str(ck / DCP_DIR), process_group=group)
    with torch.no_grad():
        for p, m in zip(params, masters):
            if m is not p:
                p.copy_(m)


def save(dirpath: Path, step: int, drafters: dict[str, torch.nn.Module], optimizer, scheduler,
         data_state: dict, generator: torch.Generator, extra: dict[str, Any], masters=(), keep: int = 3,
         sharded: Path | None = None, weights: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """`weights`: a sharded drafter's whole weights, gathered by every drafter rank (its modules hold shards)."""
    bad = nonfinite_tensors(weights or drafters, masters)
    if bad:
        raise NonFiniteWeights(f"refusing to save the checkpoint of step {step}: {len(bad)} tensor(s) hold NaN or "
                               f"infinite values ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    root = dirpath / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    clean_temporaries(dirpath)
    _reached("begin", step)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    _reached("tmp-created", step)
    try:
        if sharded is not None:
            os.rename(sharded, tmp / DCP_DIR)
        _write_step(tmp, step, weights or drafters, optimizer, scheduler, data_state, generator, extra, masters,
                    sharded is not None)
    except BaseException:      # a full disk, an unwritable directory, Ctrl-C: no half-written step is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / f"step-{step:08d}"
    if final.exists() and verify(final) is None:   # the same step again (a resume that stopped where it began):
        shutil.rmtree(tmp)                         # keep the complete one on disk rather than swap it non-atomically
    else:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    fsync_dir(root)
    _reached("renamed", step)
    _point_latest(dirpath, final, step)
    _reached("linked", step)
    for old in _steps(dirpath)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)
    _reached("pruned", step)
    return dirpath / "checkpoint"


def _write_step(tmp: Path, step: int, drafters, optimizer, scheduler, data_state, generator, extra, masters,
                sharded: bool = False) -> None:
    files = sorted(f"{DCP_DIR}/{p.name}" for p in (tmp / DCP_DIR).iterdir()) if sharded else []
    for name, m in drafters.items():
        sd = m if isinstance(m, dict) else m.state_dict()
        save_tensors({k: v.detach().contiguous().cpu() for k, v in sd.items()}, tmp / f"{name}.safetensors",
                      {"step": str(step), "format": "dflash-graph drafter"})
        files.append(f"{name}.safetensors")
    _reached("weights-written", step)
    # through a Python file, so a failed write is an OSError with its errno (torch's own writer says RuntimeError)
    with open(tmp / "trainer.pt", "wb") as f:
        torch.save({"optimizer": None if sharded else optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "generator": generator.get_state(), "torch_rng": torch.get_rng_state(),
                    "masters": [] if sharded else [m.detach().cpu() for m in masters]}, f)
    files.append("trainer.pt")
    _reached("trainer-written", step)
    (tmp / "state.json").write_text(json.dumps({"step": step, "data": data_state, **extra}, indent=2))
    files.append("state.json")
    _reached("state-written", step)
    for f in files:
        fsync_file(tmp / f)
    manifest = {"format": FORMAT, "step": step,
                "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files}}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    fsync_file(tmp / "manifest.json")
    fsync_dir(tmp)
    _reached("manifest-written", step)


def _point_latest(dirpath: Path, final: Path, step: int) -> None:
    link = dirpath / "checkpoint"
    if link.exists() and not link.is_symlink():   # the older format's directory: keep it as a fallback
        legacy = dirpath / ".checkpoint.old"
        if legacy.exists():
            shutil.rmtree(legacy)
        link.rename(legacy)
    tmp = dirpath / f".checkpoint.lnk{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(final.relative_to(dirpath))
    _reached("link-made", step)
    os.replace(tmp, link)
    fsync_dir(dirpath)


def _steps(dirpath: Path) -> list[Path]:
    """Saved steps, newest first."""
    root = dirpath / "checkpoints"
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else ()) if (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def verify(ck: Path, hashes: bool = True) -> str | None:
    """None if the checkpoint directory is complete and unmodified, else what is wrong with it (hashes=False:
    complete, each file of the manifest's size, without reading the files)."""
    mpath = ck / "manifest.json"
    if not mpath.exists():
        if (ck / "state.json").exists() and (ck / "trainer.pt").exists():
            return _verify_legacy(ck)
        return "no manifest.json (an incomplete save)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"manifest.json is not valid ({type(e).__name__})"
    for name, want in files.items():
        p = ck / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != want.get("bytes"):
            return f"{name} has {p.stat().st_size:,} bytes, the manifest says {want.get('bytes'):,} (truncated?)"
        if hashes and _sha256(p) != want.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (modified or corrupted)"
    try:
        json.loads((ck / "state.json").read_text())["step"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"state.json is not valid ({type(e).__name__})"
    return None


def _verify_legacy(ck: Path) -> str | None:
    try:
        json.loads((ck / "state.json").read_text())["step"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"state.json is not valid ({type(e).__name__})"
    return None


def candidates(dirpath: Path) -> list[Path]:
    """Where a checkpoint may be, newest first: saved steps, then the older format's two directories."""
    out = _steps(dirpath)
    for legacy in (dirpath / "checkpoint", dirpath / ".checkpoint.old"):
        if legacy.is_dir() and not legacy.is_symlink():
            out.append(legacy)
    return out


def newest_state(dirpath: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint on disk that is complete (manifest and file sizes; not hashed): its state.json and
    directory."""
    for ck in candidates(dirpath):
        if verify(ck, hashes=False) is None:
            try:
                state = json.loads((ck / "state.json").read_text())
                int(state["step"])
                return state, ck
            except (ValueError, KeyError, TypeError, OSError):
                continue
    return None


def newest_complete(dirpath: Path) -> tuple[int, Path] | None:
    """The newest checkpoint on disk that is complete (not hashed): its step and directory."""
    found = newest_state(dirpath)
    return None if found is None else (int(found[0]["step"]), found[1])


def run_directory(path: str | Path, flag: str) -> Path:
    """The run directory (or one checkpoint) a flag names; a GraphError naming the flag when it is missing or a
    file, before anything is built."""
    from ..errors import GraphError, Location, Problem

    d = Path(path)
    if not d.exists():
        raise GraphError(Problem("no such directory", Location(flag=f"{flag} {d}"),
                                 hint=f"{flag} takes the --out directory of a `dflash-graph run` (runs/<graph name> "
                                      "unless --out named another)"))
    if not d.is_dir():
        raise GraphError(Problem("a file, not a run directory", Location(flag=f"{flag} {d}"),
                                 hint=f"{flag} takes the --out directory of a `dflash-graph run`"))
    return d


def is_checkpoint(d: Path) -> bool:
    """`d` is one checkpoint (a step directory, or the `checkpoint` link to one), not a run directory."""
    return (d / "manifest.json").is_file() or (d / "state.json").is_file()


def newest_good(dirpath: Path, flag: str, doing: str = "resuming from") -> Path:
    """The newest checkpoint that verifies: in a run's --out directory `dirpath` (each newer one that does not is
    named on stderr and skipped), or `dirpath` itself when it is one checkpoint. None is a GraphError that names
    `flag` (how the user gave the directory), each checkpoint found and what is wrong with it."""
    from ..errors import GraphError, Location, Problem

    run_directory(dirpath, flag)
    one = is_checkpoint(dirpath)
    skipped = []
    for ck in [dirpath] if one else candidates(dirpath):
        why = verify(ck)
        if why is None:
            for p, w in skipped:
                print(f"warning: checkpoint {p} is unusable ({w}); {doing} {ck}", file=sys.stderr)
            return ck
        skipped.append((ck, why))
    if not skipped:
        raise GraphError(Problem(f"{dirpath} holds no checkpoint", Location(flag=f"{flag} {dirpath}"),
                                 hint=f"{flag} takes the --out directory of a `dflash-graph run` that saved a "
                                      "checkpoint (runs/<graph name> unless --out named another)"))
    hint = (f"pass the run directory ({dirpath.parent}) to fall back to an older checkpoint" if one else
            "no complete checkpoint is left in this directory: train again (a new run with --out)")
    raise GraphError([Problem(f"unusable checkpoint: {w}", Location(str(p)), hint=hint) for p, w in skipped])


def load(dirpath: Path) -> tuple[dict, Path]:
    """The state of the newest checkpoint that verifies, and its directory (newest_good)."""
    ck = newest_good(dirpath, "--resume")
    return json.loads((ck / "state.json").read_text()), ck


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file, or a GraphError naming it when it cannot be read as one (a checkpoint of
    the older format has no manifest that would have caught it)."""
    from safetensors import SafetensorError

    from ..errors import GraphError, Location, Problem

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise GraphError(Problem(f"{path.name} is not a readable safetensors file ({str(e).splitlines()[0][:200]})",
                                 Location(str(path)),
                                 hint="the file is truncated or corrupted: use an older checkpoint of the run "
                                      "(checkpoints/step-N), or train again")) from None


def restore(ck: Path, drafters: dict[str, torch.nn.Module], optimizer, scheduler, generator, masters=(),
            group=None) -> None:
    """Load a checkpoint into this process's drafter, optimizer and generators. `group`: the process group of a
    data-parallel drafter's ranks (every one of them calls this), for a sharded checkpoint (NOTE [Sharded
    checkpoints]); None in one process or on the one rank that trains."""
    from ..errors import GraphError, Location, Problem

    hint = ("the graph's drafter changed since this checkpoint was written (models.<drafter>.config, dims, or a "
            "config.json it reads): resume with the graph and --set flags the run used (run.json in the run "
            "directory records them), or start a new run with another --out")
    for name, m in drafters.items():
        path = ck / f"{name}.safetensors"
        if not path.is_file():
            saved = sorted(p.stem for p in ck.glob("*.safetensors"))
            raise GraphError(Problem(f"checkpoint {ck} has no weights for the drafter '{name}' this graph trains "
                                     f"(it holds: {', '.join(saved) or 'none'})", Location(str(ck)), hint=hint))
        state = read_weights(path)
        diff = state_dict_differences(m.state_dict(), state)
        if diff:
            raise GraphError(Problem(f"this checkpoint does not fit the drafter '{name}' the graph builds: {diff}",
                                     Location(str(path)), hint=hint))
        dev = next(m.parameters()).device
        live = m.state_dict()
        m.load_state_dict({k: _like(v.to(dev), live[k]) for k, v in state.items()})
    import pickle

    try:
        blob = torch.load(ck / "trainer.pt", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise GraphError(Problem(f"checkpoint {ck}/trainer.pt cannot be read as tensors and plain data "
                                 f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                                 Location(str(ck / "trainer.pt")),
                                 hint="checkpoints are loaded with weights_only=True: a file holding other Python "
                                      "objects is refused, never run")) from None
    try:
        if blob.get("optimizer") is None:      # a sharded checkpoint: masters and AdamW state by name, through DCP
            params = [p for m in drafters.values() for p in m.parameters() if p.requires_grad]
            _restore_sharded(ck, drafters, optimizer, masters, params, group)
        else:
            optimizer.load_state_dict(blob["optimizer"])
            for p in masters:    # a whole optimizer (one rank's) into a sharded drafter: each rank its shard
                st = optimizer.state.get(p, {})
                for k, v in st.items():
                    if torch.is_tensor(v):
                        st[k] = _like(v, p)
        scheduler.load_state_dict(blob["scheduler"])
        generator.set_state(blob["generator"])
        saved_masters = blob.get("masters", []) if blob.get("optimizer") is not None else []
        if masters and blob.get("optimizer") is not None and len(saved_masters) != len(masters):
            raise ValueError(f"{len(saved_masters)} fp32 master tensors saved, the drafter has {len(masters)}")
        with torch.no_grad():
            for i, (m, saved) in enumerate(zip(masters, saved_masters)):
                if tuple(m.shape) != tuple(saved.shape):
                    raise ValueError(f"fp32 master {i} has shape {list(saved.shape)} in the checkpoint, "
                                     f"{list(m.shape)} in the drafter")
                m.copy_(_like(saved.to(m.device), m))
    except (ValueError, KeyError, RuntimeError) as e:   # the optimizer state of another drafter
        raise GraphError(Problem(f"checkpoint {ck}/trainer.pt does not fit this graph's optimizer: "
                                 f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
                                 Location(str(ck / "trainer.pt")), hint=hint)) from None
    torch.set_rng_state(blob["torch_rng"])


def state_dict_differences(want: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], first: int = 3) -> str:
    """'' when `saved` loads into a module whose state dict is `want`; else the keys and shapes that differ (the
    first few of each kind)."""
    def few(items: list[str]) -> str:
        return "; ".join(items[:first]) + (f"; ... ({len(items)} in all)" if len(items) > first else "")

    missing = [k for k in want if k not in saved]
    unexpected = [k for k in saved if k not in want]
    shapes = [f"{k} is {list(saved[k].shape)} in the checkpoint, {list(want[k].shape)} in the graph"
              for k in want if k in saved and tuple(saved[k].shape) != tuple(want[k].shape)]
    parts = []
    if shapes:
        parts.append(f"{len(shapes)} tensor(s) of another shape ({few(shapes)})")
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the graph's drafter ({few(unexpected)})")
    return "; and ".join(parts)
