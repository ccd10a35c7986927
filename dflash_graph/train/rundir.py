"""Run directories: what `dflash-graph run --out DIR` may write over, what it records, and what a resume may change.

- A directory that already holds a run (metrics, checkpoints or run.json) is refused unless `--resume` continues
  it or `--overwrite` replaces it: a rerun never silently overwrites a finished run.
- `run.json` records the command line, the graph file and `--set` flags, the resolved graph (the whole
  document with the flags applied and config.json files read in) and the steps of the run, and each resume
  after it (a resume into another --out copies the record it continues).
- A resume compares the resolved graph it is given with the one recorded: any difference is refused, naming
  each path with its old and new value, except the keys in ALWAYS_OK and the memory figures (devices' capacity
  and outside_allocator, [memory] host_memory: they change no state a checkpoint holds)
  and those in WITH_FLAG when `--allow-change KEY` names them (safe to change mid-run, but a different run).

NOTE [What a resume continues]: a run's length and learning-rate schedule are fixed when it starts: --steps
(else train.steps) steps, and the schedule (warmup, then cosine to 10% of train.lr) over as many. Each checkpoint
records both ("steps", "schedule_steps" in state.json), with the run's smoothed values (train/metrics.py,
RunStats), and a resume takes them from it, not from the graph: a resumed run's per-step losses, lr and smoothed
loss are the uninterrupted run's. `--steps N` on a resume is the one way to change the length (a changed
train.steps is refused, pointing to it): N above the steps done trains to N (past the schedule's end, at the lr
it ends at: no jump), N equal to them is a finished run, N below them is refused. A resume of a finished run
changes nothing and exits 0 (`finished`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import GraphError, Location, Problem, short

RUN_FILE = "run.json"
# what a run writes into its directory (and --overwrite removes)
OWNED = ("metrics.jsonl", "memory.json", RUN_FILE, "checkpoint", "checkpoints", ".checkpoint.old")
# what changes no step's result (held-out evaluation draws from its own generator and leaves the model as it was)
ALWAYS_OK = frozenset({"train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
                       "train.max_nonfinite_steps", "train.eval_every", "train.eval_batches", "graph.description"})
WITH_FLAG = frozenset({"train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip"})


def layout_key(k: str) -> bool:
    """Where the graph runs, not what a step computes: the devices, their groups and ranks, a node's device, the
    launch, a trainable model's `parallel`, the graph's name. A resume may change them (a run saved on N drafter
    ranks resumes on M: NOTE [Sharded checkpoints], train/checkpoint.py); the losses continue as the global batch
    (the replicas, grad_accum) and the reduction order allow (docs/distributed.md)."""
    return (k.startswith(("devices.", "groups.", "launch.")) or k == "graph.name"
            or (k.startswith("nodes.") and k.endswith(".device"))
            or (k.startswith("models.") and k.endswith(".parallel")))


def _memory_figure(key: str) -> bool:
    """A device's capacity or outside_allocator, or [memory] host_memory: what check compares the peaks with, not
    state a checkpoint holds. Always OK on resume: a device mapped to the CPU takes the host's available memory as
    its capacity, which differs from one invocation to the next."""
    parts = key.split(".")
    return key == "memory.host_memory" or (len(parts) == 3 and parts[0] == "devices"
                                           and parts[2] in ("capacity", "outside_allocator"))


def holds_a_run(d: Path) -> bool:
    return d.is_dir() and any((d / f).exists() or (d / f).is_symlink() for f in OWNED)


def prepare(out: Path, resume: Path | None, overwrite: bool) -> None:
    """Refuse to write over an existing run; with --overwrite, remove what the earlier run wrote."""
    if out.exists() and not out.is_dir():
        raise GraphError(Problem(f"--out {out} is a file, not a directory", Location(None, None, None, "--out"),
                                 hint="name a new directory"))
    if resume is not None and resume.resolve() == out.resolve():
        return
    if not holds_a_run(out):
        return
    if not overwrite:
        raise GraphError(Problem(f"{out} already holds a run ({_summary(out)})", Location(None, None, None, f"--out {out}"),
                                 hint=f"continue it with --resume {out}, replace it with --overwrite, or choose another --out"))
    removed: list[str] = []
    for f in OWNED:
        p = out / f
        try:
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p)
            else:
                continue
        except OSError as e:     # what is gone, what is left, and that nothing new was written yet (exit 2)
            left = [g for g in OWNED if (out / g).exists() or (out / g).is_symlink()]
            raise GraphError(Problem(
                f"--overwrite could not remove {p}: {e.strerror or e}; removed: {', '.join(removed) or 'nothing'}; "
                f"left (maybe in part): {', '.join(left)}; nothing of the new run was written",
                Location(None, None, None, "--overwrite"),
                hint=f"make {out} writable (or remove what is left yourself), then run again with --overwrite; or "
                     "choose another --out")) from None
        removed.append(f)


def _summary(d: Path) -> str:
    try:
        n = sum(1 for ln in open(d / "metrics.jsonl") if ln.strip())
        return f"{n} steps in metrics.jsonl"
    except OSError:
        return "a checkpoint" if (d / "checkpoints").exists() or (d / "checkpoint").exists() else "run files"


def flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """{'train.lr': 3e-4, 'nodes[2].params.queue': 1, ...}; nodes are named by id, not by position."""
    out: dict[str, Any] = {}
    if isinstance(doc, Mapping):
        for k, v in doc.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(doc, list) and prefix == "nodes" and all(isinstance(n, Mapping) and "id" in n for n in doc):
        for n in doc:
            out.update(flatten({k: v for k, v in n.items()}, f"nodes.{n['id']}"))
    elif isinstance(doc, list) and doc and any(isinstance(x, (Mapping, list)) for x in doc):
        for i, v in enumerate(doc):
            out.update(flatten(v, f"{prefix}[{i}]"))
    else:
        out[prefix] = doc
    return out


def _jsonable(doc: Any) -> Any:
    return json.loads(json.dumps(doc, default=str))


def record(out: Path, spec, argv: Sequence[str], overrides: Sequence[str], steps: int,
           resume: Path | None = None, start: int = 0, flags: Mapping[str, Any] | None = None) -> None:
    """Write run.json, or on a resume extend the record of the run it continues (`resume`'s run.json, also when
    it is another directory than `out`) with this invocation: its command, graph, steps, the step it started
    from, and `flags` (how_run: what of the command line shapes how the graph runs)."""
    graph = str(Path(spec.file).resolve()) if spec.file else None      # eval and export rebuild the graph from it
    entry = {"argv": list(argv), "cwd": os.getcwd(), "graph": graph, "overrides": list(overrides),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": steps, **({"run_with": dict(flags)} if flags else {})}
    if resume is not None:
        try:
            run = json.loads((resume / RUN_FILE).read_text())
        except (OSError, ValueError):
            run = None
        if isinstance(run, dict):
            here = {"from_step": start}
            if resume.resolve() != out.resolve():
                here["from_dir"] = str(resume)
            run.setdefault("resumes", []).append({**entry, **here, "resolved": _jsonable(spec.resolved)})
            write_json(out / RUN_FILE, run)
            return
    write_json(out / RUN_FILE, {**entry, "resolved": _jsonable(spec.resolved)})


def how_run(no_rewrite: bool, rules_off: Sequence[str], device_map: Sequence[str]) -> dict[str, Any]:
    """The flags that change how the graph runs, though not what it computes: the rewrites (proven to compute the
    same, but in another order, so rounded differently) and the devices. run.json records them."""
    return {"rewrite": not no_rewrite, "without_rule": sorted(rules_off), "device_map": list(device_map)}


def changed_flags(resume: Path, flags: Mapping[str, Any]) -> list[str]:
    """Notes for a resume run otherwise than the invocation before it (how_run): allowed, but its losses may
    then differ from the uninterrupted run's in the last digits."""
    try:
        run = json.loads((resume / RUN_FILE).read_text())
        before = (run.get("resumes") or [run])[-1].get("run_with")
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return []
    if not isinstance(before, dict):
        return []

    def said(k: str, v: Any) -> str:
        if k == "rewrite":
            return "rewritten" if v else "as written (--no-rewrite)"
        flag = "--without-rule" if k == "without_rule" else "--device-map"
        return " ".join(f"{flag} {x}" for x in v) if v else f"without {flag}"

    return [f"--resume {resume}: the run ran {said(k, before[k])}, this resume {said(k, v)}: the same computation, "
            "rounded differently, so its losses may differ from an uninterrupted run's in the last digits"
            for k, v in flags.items() if k in before and before[k] != v]


def resumed_steps(resume: Path, state: dict, flag: int | None, default: int) -> tuple[int, int, str | None]:
    """What a resume from the checkpoint `state` trains to (NOTE [What a resume continues]): (steps,
    schedule_steps, a note for the user or None). `flag`: --steps; `default`: train.steps, for a checkpoint of
    an older version, which did not record the run's steps."""
    done = int(state["step"])
    recorded = state.get("steps")
    note = None
    if recorded is None:
        steps = schedule = flag if flag is not None else default
        how = "--steps" if flag is not None else "train.steps"
        note = (f"{resume}: the checkpoint of step {done} does not record its run's steps (an older version wrote "
                f"it): training to step {steps} ({how}), the learning rate on a schedule over {steps} steps")
    else:
        recorded = int(recorded)
        schedule = int(state.get("schedule_steps") or recorded)
        steps = flag if flag is not None else recorded
        if steps != recorded and steps > done:
            note = (f"--steps {steps}: the run was to train {recorded} steps and now trains {steps}; " +
                    (f"steps {max(schedule, done) + 1}-{steps} keep the learning rate its schedule ends at "
                     f"(10% of train.lr; the schedule was fixed over {schedule} steps when the run started)"
                     if steps > schedule else f"its learning-rate schedule stays the one over {schedule} steps"))
    if steps < done:
        what = f"--steps {steps}" if flag is not None else f"train.steps = {steps}"
        where = Location(flag="--steps") if flag is not None else Location(path="train.steps")
        raise GraphError(Problem(f"{what} is below the {done} steps {resume} has already trained", where,
                                 expected=f"more than {done} steps", actual=str(steps),
                                 hint=f"a run cannot be shortened below its checkpoint: --steps N with N above {done} "
                                      "trains it further" + ("" if recorded is None else
                                                             f"; without --steps it trains to its {recorded} steps")))
    return steps, schedule, note


def finished_message(resume: Path, done: int, ck: Path) -> str:
    """What a resume of a finished run says (exit 0; nothing is written)."""
    export = "" if (resume / "export").is_dir() else (
        f"\n  its export is missing: dflash-graph export {resume} --out {resume / 'export'}")
    return (f"{resume}: the run is finished ({done} of {done} steps; checkpoint {ck}): nothing to do, nothing was "
            f"changed\n  to train it further: --resume {resume} --steps N, with N above {done}{export}")


def finished(resume: Path, flag: int | None) -> str | None:
    """Before anything is built: the message for a resume of a finished run (its newest checkpoint, verified, is
    at the run's last step, or at --steps), else None (the trainer resumes, or says why it cannot). A --steps
    below the steps done is refused here too."""
    from . import checkpoint

    found = checkpoint.newest_state(resume)
    if found is None:
        return None
    state, ck = found
    if state.get("steps") is None and flag is None:     # an older checkpoint: the trainer decides from train.steps
        return None
    steps, _, _ = resumed_steps(resume, state, flag, 0)
    if steps > int(state["step"]) or checkpoint.verify(ck) is not None:
        return None                                     # (the trainer falls back past a corrupted one, naming it)
    return finished_message(resume, int(state["step"]), ck)


def write_json(path: Path, obj: dict) -> None:
    """Write a JSON file through a temporary and a rename: a full disk leaves the previous file whole, and no
    temporary behind."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=str))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def resume_dir(resume: Path) -> None:
    """Refuse, before anything is built, a --resume that names no run directory."""
    from .checkpoint import run_directory

    run_directory(resume, "--resume")
    flag = Location(flag=f"--resume {resume}")
    hint = "--resume takes the --out directory of an earlier run (runs/<graph name> unless --out named another)"
    if not holds_a_run(resume):
        raise GraphError(Problem(f"{resume} holds no run (no {RUN_FILE}, metrics or checkpoint)", flag,
                                 hint=hint + "; to start a run there, use --out"))


def check_resume(resume: Path, spec, allow: Sequence[str]) -> None:
    """Refuse a resume whose resolved graph differs from the run's in anything but ALWAYS_OK (and the WITH_FLAG
    keys `--allow-change` names), naming each difference."""
    bad_flags = [a for a in allow if a not in WITH_FLAG]
    if bad_flags:
        raise GraphError(Problem(f"--allow-change {bad_flags[0]}: only {', '.join(sorted(WITH_FLAG))} may be allowed "
                                 "to change on resume", Location(None, None, None, f"--allow-change {bad_flags[0]}"),
                                 hint="anything else changes what the checkpoint holds: start a new run"))
    resume_dir(resume)
    path = resume / RUN_FILE
    if not path.exists():   # a checkpoint without run.json: what versions before run.json wrote
        print(f"note: {resume} has no {RUN_FILE} (a run from an older version): the graph is not compared with the "
              "checkpoint's", file=sys.stderr)
        return
    try:
        run = json.loads(path.read_text())
        # the latest invocation's graph: a resume already accepted with --allow-change becomes the new reference
        old = (run.get("resumes") or [run])[-1]["resolved"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise GraphError(Problem(f"{path} is not valid ({type(e).__name__})", Location(str(path)),
                                 hint="it records the graph the run used; without it the resume cannot be checked")) from None
    a, b = flatten(old), flatten(_jsonable(spec.resolved))
    diffs, layout = [], []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<absent>") == b.get(k, "<absent>") or k in ALWAYS_OK or _memory_figure(k) or k in allow:
            continue
        (layout if layout_key(k) else diffs).append(k)
    if layout and not diffs and os.environ.get("RANK", "0") == "0":
        print(f"note: --resume {resume}: the layout changed ({', '.join(layout[:4])}"
              f"{', ...' if len(layout) > 4 else ''}): the run continues on this graph's devices and ranks",
              file=sys.stderr)
    if not diffs:
        return
    problems = []
    for k in diffs:
        old_v, new_v = a.get(k, "<absent>"), b.get(k, "<absent>")
        hint = (f"allow it with --allow-change {k}" if k in WITH_FLAG else
                f"a resume takes the run's steps from its checkpoint; to train it to {short(new_v)} steps, keep "
                f"train.steps as it was and pass --steps {short(new_v)}" if k == "train.steps" else
                "this changes what the checkpoint holds; resume with the graph and --set flags the run used "
                "(recorded in run.json), or start a new run")
        problems.append(Problem(f"--resume {resume}: {k} was {short(old_v)} in the run, is {short(new_v)} now",
                                spec.loc(*_toml_path(k, spec)), expected=short(old_v), actual=short(new_v), hint=hint))
    raise GraphError(problems)


def _toml_path(flat: str, spec) -> tuple:
    """'nodes.loss.params.gamma' -> ('nodes', index, 'params', 'gamma') for the line lookup, where it can."""
    parts: list = [int(p) if p.isdigit() else p for p in flat.replace("[", ".").replace("]", "").split(".") if p != ""]
    if len(parts) > 1 and parts[0] == "nodes":
        idx = next((n.index for n in spec.nodes if n.id == parts[1]), None)
        parts = ["nodes", *([idx] if idx is not None else []), *parts[2:]]
    return tuple(parts)
