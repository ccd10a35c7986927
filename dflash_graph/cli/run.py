"""`dflash-graph run`: check (refusing a predicted OOM unless --force), then train, then export the drafter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..models.registry import kernel_notes
from ..rewrite.pipeline import compile_graph
from .options import host_overrides, mapped_overrides
from .report import render_host, render_memory, render_ooms, render_rewrites


def _allocator_env(plan) -> None:
    """Run under the allocator settings check assumed: [memory] becomes PYTORCH_CUDA_ALLOC_CONF (before torch
    initialises CUDA). A setting already in the environment wins, and check is told so."""
    mem = plan.typed.ctx.spec.memory
    conf = []
    if mem.expandable_segments:
        conf.append("expandable_segments:True")
    if mem.max_split_size:
        conf.append(f"max_split_size_mb:{mem.max_split_size // 2**20}")
    if conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf)
    elif os.environ.get("PYTORCH_CUDA_ALLOC_CONF") and not conf:
        print(f"note: PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']} is set, but the graph's "
              "[memory] assumes the default allocator", file=sys.stderr)


def _cache_source(args, plan, launch):
    """run --hidden-states DIR: the drafter side's inputs from the cache (train/hidden_cache.CacheSource), which
    is refused when its signature differs from this graph's. `launch`: under torchrun, the drafter side's ranks
    (NOTE [From disk under torchrun]): this rank reads the samples of the replicas it trains."""
    from ..errors import GraphError, Location, Problem

    if args.hybrid and not args.hidden_states:
        raise GraphError(Problem("--hybrid captures into the cache --hidden-states names", Location(flag="--hybrid"),
                                 hint="add --hidden-states DIR"))
    if launch is not None:
        _refuse_hybrid_under_torchrun(args, plan)
    if args.loader_workers < 0:
        raise GraphError(Problem(f"--loader-workers must be 0 or more, got {args.loader_workers}",
                                 Location(flag=f"--loader-workers {args.loader_workers}"), hint="e.g. --loader-workers 2"))
    from ..train.hidden_cache import CacheSource, HybridSource

    if args.hybrid:
        src = HybridSource(plan, Path(args.hidden_states), None, args.on_bad_shard, args.loader_workers,
                           device_map=args.device_map)
        from ..analysis.capture import samples_per_step

        steps = args.steps if args.steps is not None else int(plan.typed.ctx.spec.train["steps"])
        if src.reader is None and src.N >= steps * samples_per_step(plan.typed):
            print(f"note: --hybrid: the cache holds {src.N} samples, every sample these {steps} steps train on, so "
                  "nothing will be read back; set [capture] samples to one epoch (--set capture.samples=N)",
                  file=sys.stderr)
        return src
    mine = None
    if launch is not None:   # the replicas whose drafter replica (the trainable nodes) is on this rank
        from ..analysis.launch import device_for
        from ..analysis.nodecost import grad_nodes

        typed, rank = plan.typed, int(os.environ["RANK"])
        mine = frozenset(r for r in range(launch.replicas) for n in grad_nodes(typed)
                         if launch.devices[device_for(typed, typed.graph[n].device, r)].rank == rank)
    return CacheSource(plan, Path(args.hidden_states), args.on_bad_shard, args.loader_workers,
                       device_map=args.device_map, own_replicas=mine)


def _from_disk_plan(plan, source, launch):
    """run --hidden-states (not --hybrid): the plan's memory cut to the drafter side, with the cache's loader on the
    host (NOTE [From-disk memory], analysis/from_disk.py). The target devices do not exist in this run, so they
    are neither printed nor part of the verdict. Under torchrun (`launch`) every rank runs a loader of its own."""
    import attrs

    from ..analysis.from_disk import from_disk_memory

    loader = source.loader_memory()
    if launch is not None:
        loader = attrs.evolve(loader, readers=launch.world_size)
    fd = from_disk_memory(plan.memory, plan.typed.ctx.spec, source.drafter_devices, loader)
    before = plan.memory_before
    if before is not None:
        before = attrs.evolve(before, devices={n: d for n, d in before.devices.items() if n in fd.memory.devices},
                              host=None)
    return attrs.evolve(plan, memory=fd.memory, memory_before=before), fd


def _render_from_disk_host(fd) -> str:
    from ..units import fmt_bytes
    from .console import span
    from .report import _host_has

    host = fd.memory.host
    n = len(host.devices)
    cpus = f"the peak{'s' if n > 1 else ''} of {span(list(host.devices))} (CPU) and " if n else ""
    return (f"host memory: {cpus}the hidden-state loader's {fd.loader.text()} need {fmt_bytes(host.need_bytes)} "
            f"together; {_host_has(host)}" + ("" if host.fits else "   OOM"))


def _refuse_hybrid_under_torchrun(args, plan) -> None:
    from ..errors import GraphError, Location, Problem

    if not getattr(args, "hybrid", False):
        return
    f = plan.typed.ctx.spec.file
    raise GraphError(Problem("--hybrid runs the target side in the run's own process, which a run from the cache "
                             "under torchrun does not have (its ranks are the drafter side's)",
                             Location(flag="--hybrid"),
                             hint=f"capture under the launch first, then train from the cache: dflash-graph launch "
                                  f"--nproc-per-node N capture {f} --out {args.hidden_states}, then dflash-graph "
                                  f"launch --nproc-per-node M run {f} --hidden-states {args.hidden_states} (N and M: "
                                  "what each command says when launched with another size)"))


def cmd_run(args) -> int:
    """Under torchrun every rank runs this. Until the process group exists, every rank checks the same graph and
    flags and reaches the same verdict: a refusal then is printed once per machine (exec.distributed.
    shared_verdict), not once per rank. After that, a rank that stops with an error of its own records it in the
    rendezvous store first, so the other ranks name it instead of reporting a lost peer."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return _cmd_run(args, {})
    from ..exec import distributed

    return distributed.under_verdicts(lambda stage: _cmd_run(args, stage), "training started")


def _cmd_run(args, stage: dict) -> int:
    from ..errors import GraphError, Location, Problem

    if args.steps is not None and args.steps < 1:
        raise GraphError(Problem(f"--steps must be a positive number of optimizer steps, got {args.steps}",
                                 Location(None, None, None, f"--steps {args.steps}"), hint="e.g. --steps 200"))
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GraphError(Problem("`run` needs torch, which is not installed (check works without it)",
                                 Location(None, None, None, "run"),
                                 hint='pip install torch && pip install -e ".[run]"')) from None

    from ..exec.distributed import under_torchrun

    if args.resume:   # a --resume that names no run is refused before the graph is compiled
        from ..train.rundir import resume_dir

        resume_dir(Path(args.resume))
    distributed = under_torchrun()
    # under torchrun every rank checks the same graph and reaches the same verdict; rank 0 prints it
    talk = not distributed or os.environ.get("RANK") == "0"
    host = host_overrides(args)   # not recorded with the --set flags in run.json: a figure of this host
    plan = compile_graph(args.graph, [*args.overrides, *host, *mapped_overrides(args, host)], rewrite=not args.no_rewrite,
                         rules_off=args.rules_off)
    spec = plan.typed.ctx.spec
    launch = None
    if distributed:   # a launch of the wrong size is the first thing to fix: refused before the report
        from ..analysis.launch import analyze_launch
        from ..exec.distributed import check_launch

        launch = analyze_launch(plan.typed)
        _refuse_hybrid_under_torchrun(args, plan)
        if getattr(args, "hidden_states", None):   # the drafter side's ranks alone (NOTE [From disk under torchrun])
            from ..analysis.capture import find_cut
            from ..analysis.from_disk import drafter_launch

            launch = drafter_launch(plan.typed, find_cut(plan.typed).drafter_devices)
        check_launch(plan.typed, launch)
    source = None     # a cache of another graph is refused before anything is printed or written
    if getattr(args, "hidden_states", None) or getattr(args, "hybrid", False):
        source = _cache_source(args, plan, launch if distributed else None)
    from_disk = None
    if source is not None and not args.hybrid:   # the drafter side alone: its devices and the loader's host memory
        plan, from_disk = _from_disk_plan(plan, source, launch if distributed else None)
    from ..train import rundir

    resume = Path(args.resume) if args.resume else None
    if resume is not None:
        # the graph as the run had it (or what --allow-change allows), then, for a finished run, say so before
        # anything is built and change nothing (exit 0)
        rundir.check_resume(resume, spec, getattr(args, "allow_change", []))
        done = rundir.finished(resume, args.steps)
        if done is not None:
            if talk:
                print(done)
            return 0
    flags = rundir.how_run(args.no_rewrite, args.rules_off, args.device_map)
    if resume is not None:
        if talk:
            for note in rundir.changed_flags(resume, flags):
                print(f"note: {note}", file=sys.stderr)
    elif getattr(args, "allow_change", []):
        raise GraphError(Problem("--allow-change only applies with --resume", Location(flag="--allow-change"),
                                 hint="drop --allow-change, or add --resume DIR to continue that run"))
    if talk:
        print(f"{spec.file}: graph '{spec.name}', {len(plan.typed.graph)} nodes; {render_rewrites(plan).splitlines()[0]}")
        print(render_memory(plan.memory, plan.memory_before))
        if from_disk is not None:
            print(_render_from_disk_host(from_disk))
        elif plan.memory.host is not None:
            print(render_host(plan.memory.host))
        for note in kernel_notes(plan.typed.ctx.models):   # what runs here differs from what check assumed
            print(note, file=sys.stderr)
        if distributed and source is not None:
            ranks = ", ".join(f"{d}={v.rank}" for d, v in launch.devices.items())
            print(f"launch (this run): {launch.world_size} rank(s), the drafter side alone, each reading its replicas' "
                  f"samples from {args.hidden_states} ({ranks})", flush=True)
        elif distributed:
            from .launch import render_launch

            print(render_launch(plan.typed).splitlines()[0].replace("launch: ", "launch (this run): "), flush=True)
    if not plan.memory.fits:
        if talk and from_disk is not None and not from_disk.memory.host.fits:
            print(f"OOM on host memory: {_render_from_disk_host(from_disk).removeprefix('host memory: ')}\n"
                  f"hint: fewer loader workers hold fewer shards (--loader-workers 0 holds 2), or capture in "
                  f"smaller shards ([capture] shard_samples); or, for a run on another host, declare its memory: "
                  f"--host-memory 512GiB", file=sys.stderr)
            if plan.memory.ooms:
                import attrs

                print(render_ooms(attrs.evolve(plan, memory=attrs.evolve(plan.memory, host=None))), file=sys.stderr)
        elif talk:
            print(render_ooms(plan), file=sys.stderr)
        if not args.force:
            if talk:
                print("refusing to run: check predicts an OOM (use --force to run anyway)", file=sys.stderr)
            return 1
    _allocator_env(plan)
    from ..exec.devices import parse_device_map
    from ..train.trainer import RunOptions, Trainer

    # --resume DIR continues in DIR; --out names another directory to continue into
    out = Path(args.out) if args.out else resume if resume is not None else Path("runs") / spec.name
    if not distributed or os.environ.get("LOCAL_RANK", "0") == "0":   # one process per machine readies the directory
        rundir.prepare(out, resume, getattr(args, "overwrite", False))
    opts = RunOptions(out=out, steps=args.steps, resume=resume,
                      device_map=parse_device_map(args.device_map), strict=args.strict,
                      progress=not args.no_progress, distributed=distributed, source=source, launch=launch)
    from ..exec.distributed import EXIT_INTERRUPTED, EXIT_LOST, Interrupted, RankLost

    stage["shared"] = False   # from here on, what fails may fail on one rank only
    try:
        trainer = Trainer(plan, opts)
    except RankLost as e:   # under torchrun: another rank stopped during setup (its own error says why)
        print(f"dflash-graph: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_LOST)   # a collective still pending in a helper thread would keep the process alive
    except Interrupted as e:   # Ctrl-C during setup: the writer says so, once (as it does in training)
        from ..exec.distributed import writer_ranks

        if int(os.environ["RANK"]) == min(writer_ranks(plan.typed, launch)):
            print(f"interrupted: {e} before training started; nothing trained", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)
    if trainer.finished:   # what `finished` above could not tell (a checkpoint of an older version)
        if trainer.is_writer:
            print(rundir.finished_message(resume, trainer.start_step, resume / "checkpoint"))
        return 0
    if getattr(args, "tensorboard", None) and trainer.is_writer:
        from ..train.progress import Progress

        trainer.progress = Progress(trainer.steps, trainer.stats, trainer.start_step, bar=not args.no_progress,
                                    log_every=int(trainer.cfg["log_every"]), tensorboard=args.tensorboard)
    if trainer.is_writer:
        try:
            out.mkdir(parents=True, exist_ok=True)
            rundir.record(out, spec, sys.argv, args.overrides, trainer.steps, resume, trainer.start_step, flags)
        except OSError as e:   # a full disk or an unwritable --out: where, what is kept, what to do (exit 2)
            from ..train.trainer import WriteFailed

            trainer.fail(trainer.write_problem(WriteFailed(rundir.RUN_FILE, out / rundir.RUN_FILE, e, trainer.start_step)))
    try:
        code = trainer.run()
    finally:
        if source is not None:
            source.close()
    if source is not None and trainer.is_writer:
        print(f"  {source.summary()}")
    if code == 0 and trainer.is_writer:
        from ..train.export import export_trainer

        try:
            hf = export_trainer(trainer, out / "export")
        except OSError as e:   # a full disk or an unwritable directory at the very end: training is kept (exit 2)
            from ..errors import GraphError

            raise GraphError(trainer.export_problem(e, out / "export")) from None
        print(f"  export (DFlash draft format, bf16; SGLang --speculative-draft-model-path): {hf}")
    return code
