"""Measure real GPU memory against check's prediction, in one prepared run (for sessions lent a GPU).

For graphs/gpu_check.toml (one GPU, the DFlash step as first written and as rewritten, default allocator and
expandable_segments) this runs `dflash-graph run` a few steps per variant, each in its own process so the peak
statistics start clean, and collects from each memory.json the predicted and measured allocated peak
(torch.cuda.max_memory_allocated), reserved peak (torch.cuda.max_memory_reserved) and the memory outside the
allocator (mem_get_info). It writes OUT/gpu_check.json and prints a table.

    python tools/gpu_check.py --out /tmp/gpu_check             # about 2-4 minutes on one H200
    python tools/gpu_check.py --out /tmp/g --device cpu --small  # exercise the script itself without a GPU

Then (unless --skip-decode) it trains graphs/tiny.toml and measures `eval`'s speculative decoding against target-only
decoding, both with the KV cache, on the device, greedy and at temperature 0.7 (OUT/gpu_check.json "decode").

It then measures the target forward alone under each forward a graph can declare (models.<name>.attn_implementation,
packing, linear_kernels), against the memory program check uses (dflash_graph/models/qwen3_5.py): the activation
peak of Qwen3_5TextModel.forward above its input, torch.cuda.max_memory_allocated on a GPU, MemTracker on CPU.
The flash-linear-attention / causal-conv1d and flash-attn programs were derived from the packages' Python wrappers
and are "not yet measured" until this runs on a GPU with them installed: the script imports them, else installs them
from --wheels DIR (pip --no-index; nothing else is reachable from a lent machine), else records why not
(OUT/gpu_check.json "kernels"). --skip-graph runs only this part.

--serve then serves a tiny drafter's export with the tiny target in SGLang and vLLM and runs their own benchmark
clients (tools/serve_check.py, the commands of docs/drafter.md), recording each engine that is not installed as
skipped, with the reason (OUT/gpu_check.json "serving").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "graphs" / "gpu_check.toml"
VARIANTS = [
    ("as_written", ["--no-rewrite"], {}),
    ("rewritten", [], {}),
    ("rewritten_expandable", ["--set", "memory.expandable_segments=true"], {}),
]
SMALL = ["dims.seq=512", "dims.anchors=8", "models.target.config.hidden_size=64", "models.target.config.vocab_size=768",
         "models.target.config.intermediate_size=128", "models.drafter.config.intermediate_size=128"]


def long_documents(seq: int, path: Path) -> Path:
    """Documents of at least `seq` tokens (the tiny corpus joined), so that each packed sequence is one document
    and the target's body runs over the whole sequence, as the prediction assumes."""
    texts = [json.loads(line)["text"] for line in open(ROOT / "graphs" / "tiny" / "corpus.jsonl")]
    joined, docs = "", []
    for t in texts:
        joined += t + "\n"
        if len(joined) > seq * 6:   # > 1 token per 6 characters in this corpus
            docs.append(joined)
            joined = ""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


# the forwards measured: (attn_implementation, packing); linear kernels are whatever imports on the machine
FORWARDS = [("sdpa", "documents"), ("sdpa", "mask"), ("eager", "documents"), ("eager", "mask"),
            ("flash_attention_2", "documents"), ("flash_attention_2", "cu_seqlens")]
# the target of graphs/gpu_check.toml's width for the forward alone (4 layers: 3 Gated DeltaNet + 1 full attention)
FORWARD_CFG = {"vocab_size": 1024, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "linear_num_key_heads": 8,
               "linear_num_value_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
FORWARD_SMALL = dict(FORWARD_CFG, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32)


def _importable(name: str) -> bool:
    import importlib

    try:
        importlib.import_module(name)
        return True
    except Exception:   # a CUDA extension built for another torch raises anything
        return False


def ensure_kernels(wheels: Path | None, device: str) -> dict[str, str]:
    """Import each kernel package, else install it from `wheels` (pip --no-index), else say why not."""
    want = {"fla": ["flash-linear-attention", "fla-core"], "causal_conv1d": ["causal-conv1d"],
            "flash_attn": ["flash-attn"]}
    status = {}
    for mod, dists in want.items():
        if _importable(mod):
            status[mod] = "installed"
            continue
        if device != "cuda":
            status[mod] = "not installed; not attempted on CPU (the kernels need CUDA/Triton)"
            continue
        if wheels is None or not wheels.is_dir():
            status[mod] = ("not installed, and no --wheels directory: a lent machine reaches no package index; "
                           "causal-conv1d and flash-attn ship CUDA builds only as sdists or GitHub release wheels")
            continue
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *dists],
                           capture_output=True, text=True)
        status[mod] = "installed from --wheels" if p.returncode == 0 and _importable(mod) else \
            "install from --wheels failed: " + (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return status


def measure_forward(cfg: dict, seq: int, docs: int, impl: str, packing: str, device: str) -> dict:
    """One body forward (no grad, no cache): measured activation peak above the input vs the program's."""
    import torch
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    from dflash_graph.models import qwen3_5 as Q

    packed = packing != "documents"
    lin = "fla" if _importable("fla") and _importable("causal_conv1d") else "torch"
    d = Q.Qwen35Dims.from_config(cfg)
    rec = {"attn_implementation": impl, "packing": packing, "linear_kernels": lin, "seq": seq, "docs": docs}
    if impl == "flash_attention_2" and not _importable("flash_attn"):
        return {**rec, "skipped": "flash-attn is not importable here"}
    dtype = torch.bfloat16
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**cfg, attn_implementation=impl)).eval().to(dev, dtype)
    n = seq // docs
    pos = torch.cat([torch.arange(n)] * (docs - 1) + [torch.arange(seq - n * (docs - 1))])[None].to(dev)
    x = torch.randn(1, seq, d.hidden_size, dtype=dtype, device=dev)
    # documents one by one: nothing outlives a call (no grad, no cache), so the longest document's call is the peak
    spans = [(0, seq)] if packed else [(n * (docs - 1), seq)]
    longest = max(e - b for b, e in spans)
    b0 = spans[0][0]
    x, pos = x[:, b0:].clone(), pos[:, b0:].clone()   # its own input, as a run hands it over (sliced outside the
    # tracker: MemTracker counts the storage of a view made while it tracks)
    try:
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.no_grad():
                model(inputs_embeds=x, position_ids=pos, use_cache=False)
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - base
        else:
            from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

            from dflash_graph.models.trace.memtrack import no_backward_hooks

            mt = MemTracker()
            mt.track_external(model)
            with torch.no_grad(), no_backward_hooks(), mt:
                model(inputs_embeds=x, position_ids=pos, use_cache=False)
            snap = mt.get_tracker_snapshot("peak")
            k = next(iter(snap))
            measured = snap[k][_MemRefType.ACT] + snap[k][_MemRefType.TEMP]
    except torch.OutOfMemoryError as e:
        return {**rec, "error": str(e)[:300]}
    predicted = Q.body_forward_workspace_bytes(d, longest, 2, attention="flash" if device == "cuda" else "cpu_flash",
                                               packed=packed, attn_implementation=impl, linear_kernels=lin)
    # a documents run over views of the input: the slice of the longest document is the live input
    return {**rec, "measured_bytes": measured, "predicted_bytes": predicted,
            "ratio": round(measured / predicted, 4) if predicted else None}


def measure_decoding(out: Path, device: str, small: bool, timeout: int) -> dict:
    """`eval`'s speculative decoding against target-only decoding, both with the target's KV cache, on `device`:
    graphs/tiny.toml trained on the CPU (200 steps; 3 with --small), then `eval --device DEVICE --json` greedy and at
    temperature 0.7 (docs/drafter.md, "eval"). Tiny's forwards are all per-op overhead on a GPU, so this measures
    the decoder's mechanics (tau, tokens per target forward, decode tokens/s of both, their ratio), not a speed-up
    a real target would see."""
    run = out / "tiny_run"
    cmd = [sys.executable, "-m", "dflash_graph", "run", str(ROOT / "graphs" / "tiny.toml"), "--out", str(run),
           "--no-progress", *(["--steps", "3"] if small else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    rec: dict = {"train": {"command": " ".join(cmd[1:]), "exit": p.returncode}}
    if p.returncode != 0:
        rec["train"]["stderr_tail"] = p.stderr[-3000:]
        return rec
    for name, extra in (("greedy", []), ("temperature_0.7", ["--temperature", "0.7"])):
        cmd = [sys.executable, "-m", "dflash_graph", "eval", str(ROOT / "graphs" / "tiny.toml"), "--checkpoint",
               str(run), "--device", device, "--json", *(["--prompts", "2", "--max-new-tokens", "8"] if small else []),
               *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        r = {"command": " ".join(cmd[1:]), "exit": p.returncode}
        try:
            r["result"] = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            r["stderr_tail"] = p.stderr[-3000:]
        rec[name] = r
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="tiny dims (to test the script)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--wheels", type=Path, help="a directory of wheels to install the kernel packages from")
    ap.add_argument("--skip-graph", action="store_true", help="only the forward measurements")
    ap.add_argument("--serve", action="store_true",
                    help="also serve a tiny drafter's export with the tiny target in SGLang and vLLM and run their "
                         "benchmark clients (tools/serve_check.py; skipped, saying why, where an engine is absent)")
    ap.add_argument("--skip-decode", action="store_true", help="no speculative decoding measurement (tiny, eval)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sets = SMALL if args.small else []
    seq = int(next((s.split("=")[1] for s in sets if s.startswith("dims.seq=")), 32768))
    corpus = long_documents(seq, args.out / "long_docs.jsonl")
    common = ["--set", f"data.corpus={corpus}"]
    for s in sets:
        common += ["--set", s]
    env = dict(os.environ)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: use --device cpu --small to test the script", file=sys.stderr)
            return 2
        total = torch.cuda.mem_get_info(0)[1]
        common += ["--set", f"devices.gpu0.capacity={total}"]
        device_map = []
        info = {"gpu": torch.cuda.get_device_name(0), "total_bytes": total, "torch": torch.__version__}
    else:
        device_map = ["--device-map", "cuda:*=cpu"]
        info = {"gpu": None}
    results = {"machine": info, "graph": str(GRAPH.relative_to(ROOT)), "variants": {}}
    for name, extra, _ in ([] if args.skip_graph else VARIANTS):
        out = args.out / name
        cmd = [sys.executable, "-m", "dflash_graph", "run", str(GRAPH), "--steps", str(args.steps), "--out", str(out),
               "--no-progress", *device_map, *common, *extra]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        rec = {"command": " ".join(cmd[1:]), "exit": p.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if p.returncode == 0 and (out / "memory.json").exists():
            rec["memory"] = json.loads((out / "memory.json").read_text())["devices"]
        else:
            rec["stderr_tail"] = p.stderr[-3000:]
        results["variants"][name] = rec
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(f"{'variant':<22} {'pred alloc':>12} {'meas alloc':>12} {'ratio':>7} {'pred resv':>12} {'meas resv':>12} "
          f"{'ratio':>7} {'outside':>10}")
    g = 2**30
    for name, rec in results["variants"].items():
        m = (rec.get("memory") or {}).get("gpu0")
        if not m:
            print(f"{name:<22} failed (exit {rec['exit']}); see gpu_check.json")
            continue
        pr, mr = m.get("predicted_reserved_bytes"), m.get("measured_reserved_bytes")
        print(f"{name:<22} {m['predicted_peak_bytes'] / g:>10.2f}Gi {m.get('measured_peak_bytes', 0) / g:>10.2f}Gi "
              f"{m.get('ratio', 0):>7.3f} {(pr or 0) / g:>10.2f}Gi {(mr or 0) / g:>10.2f}Gi "
              f"{(mr / pr if pr and mr else 0):>7.3f} {m.get('measured_outside_allocator_bytes', 0) / g:>8.2f}Gi")
    # ---- the target forward alone, per declared forward ----
    sys.path.insert(0, str(ROOT))
    results["kernels"] = ensure_kernels(args.wheels, args.device)
    fcfg, fseq = (FORWARD_SMALL, 256) if args.small else (FORWARD_CFG, 8192)
    results["forwards"] = []
    for impl, packing in FORWARDS:
        if impl == "eager" and not args.small:
            fs = 2048    # eager's [heads, seq, seq] scores: keep them small
        else:
            fs = fseq
        rec = measure_forward(fcfg, fs, 4, impl, packing, args.device)
        results["forwards"].append(rec)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(f"\nkernel packages: " + ", ".join(f"{k}: {v}" for k, v in results["kernels"].items()))
    print(f"{'forward':<34} {'linear':>6} {'seq':>6} {'measured':>12} {'predicted':>12} {'ratio':>7}")
    for r in results["forwards"]:
        name = f"{r['attn_implementation']} / {r['packing']}"
        if "measured_bytes" in r:
            print(f"{name:<34} {r['linear_kernels']:>6} {r['seq']:>6} {r['measured_bytes'] / 2**20:>10.1f}Mi "
                  f"{r['predicted_bytes'] / 2**20:>10.1f}Mi {r['ratio']:>7.4f}")
        else:
            print(f"{name:<34} {r['linear_kernels']:>6} {r['seq']:>6} {r.get('skipped') or r.get('error')}")
    if not args.skip_decode:
        results["decode"] = measure_decoding(args.out, args.device, args.small, args.timeout)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        print(f"\n{'decoding (tiny, eval)':<22} {'tau':>7} {'tok/fwd':>8} {'spec tok/s':>11} {'target tok/s':>13} "
              f"{'decode x':>9} {'lossless':>9}")
        for name, r in results["decode"].items():
            m = r.get("result") if isinstance(r, dict) else None
            if name == "train" or not m:
                if name != "train" or r.get("exit"):
                    print(f"{name:<22} failed (exit {r.get('exit')}); see gpu_check.json")
                continue
            print(f"{name:<22} {m['tau']:>7} {m['tokens_per_target_forward']:>8} "
                  f"{m['speculative_decode_tokens_per_s']:>11} {m['greedy_decode_tokens_per_s']:>13} "
                  f"{m['decode_speedup']:>9} {str(m['lossless']):>9}")
    if args.serve:   # the export through the serving engines (docs/drafter.md, "Serving the export")
        from serve_check import run_all

        run = args.out / "tiny_run"
        p = subprocess.run([sys.executable, "-m", "dflash_graph", "run", str(ROOT / "graphs" / "tiny.toml"),
                            "--steps", "20", "--out", str(run), "--no-progress", "--overwrite"],
                           capture_output=True, text=True, timeout=args.timeout, env=env)
        results["serving"] = (run_all(str(ROOT / "graphs" / "tiny"), str(run / "export"),
                                      str(ROOT / "graphs" / "tiny" / "bench" / "prompt.jsonl"), 4, 8,
                                      args.out / "serving", args.timeout) if p.returncode == 0 else
                              [{"error": f"training the tiny drafter failed: {p.stderr[-2000:]}"}])
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        for r in results["serving"]:
            print(f"serving {r.get('engine', '-')}: " + (f"skipped: {r['skipped']}" if "skipped" in r else
                  r.get("error") or f"accept length {r['accept_length']}, {r['output_tokens_per_s']} tok/s"))
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 0 if all(r["exit"] == 0 for r in results["variants"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
