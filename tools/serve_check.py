"""Serve an exported drafter with its target in SGLang and in vLLM, and run each engine's own benchmark client.

The commands are the ones docs/drafter.md ("Serving the export") gives; `commands()` builds them and
tests/test_eval_bench.py checks that the page shows exactly these. For each engine that imports here and a CUDA
device, it starts the server, waits for it to answer, runs the client, keeps its output, and stops the server (its
whole process group, also on failure or timeout). An engine that is not installed, or a machine without a GPU, is
recorded as skipped with the reason; nothing is downloaded.

    python tools/serve_check.py --target graphs/tiny --draft runs/tiny/export --prompts graphs/tiny/bench/prompt.jsonl \
        --out /tmp/serve_check

tools/gpu_check.py calls `run_all` with `--serve` (the tiny target and a drafter it trains for a few steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ENGINES = ("sglang", "vllm")
PORTS = {"sglang": 30000, "vllm": 8000}


def commands(engine: str, target: str, draft: str, prompts: str, block: int, n: int, port: int | None = None
             ) -> tuple[list[str], list[str]]:
    """(server, benchmark client) for `engine`: `target` an HF model directory with its tokenizer, `draft` the
    export (`dflash-graph export`), `prompts` a JSONL of {"prompt": ...} records (vLLM's custom dataset format, and
    eval's `prompt` format), `block` the drafter's block size (tokens verified per target forward)."""
    port = port or PORTS[engine]
    if engine == "sglang":
        server = ["python", "-m", "sglang.launch_server", "--model-path", target,
                  "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", draft,
                  "--speculative-num-draft-tokens", str(block), "--trust-remote-code", "--port", str(port)]
        # SGLang's client prints "Accept length" (the server's avg_spec_accept_length) with its throughput
        client = ["python", "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port),
                  "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "256",
                  "--num-prompts", str(n), "--max-concurrency", "1"]
        return server, client
    if engine == "vllm":
        spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": block - 1})
        server = ["vllm", "serve", target, "--speculative-config", spec, "--port", str(port)]
        client = ["vllm", "bench", "serve", "--model", target, "--port", str(port), "--dataset-name", "custom",
                  "--dataset-path", prompts, "--custom-output-len", "256", "--num-prompts", str(n),
                  "--max-concurrency", "1", "--temperature", "0"]
        return server, client
    raise ValueError(engine)


def why_not(engine: str) -> str | None:
    """Why `engine` cannot be served here, or None."""
    if importlib.util.find_spec(engine) is None:
        return f"{engine} is not installed here (pip install {engine}; nothing is downloaded by this check)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: the serving engines need a GPU"
    return None


def _ready(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        for path in ("/health", "/v1/models"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
        time.sleep(3)
    return False


def _stop(proc: subprocess.Popen) -> None:
    """The server and every process it started (its own process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


ACCEPT = re.compile(r"(?:Accept length|Mean acceptance length|Acceptance length)\s*:\s*([\d.]+)", re.I)
THROUGHPUT = re.compile(r"Output token throughput \(tok/s\)\s*:\s*([\d.,]+)")


def run_engine(engine: str, target: str, draft: str, prompts: str, block: int, n: int, out: Path,
               timeout: int = 900) -> dict:
    why = why_not(engine)
    server, client = commands(engine, target, draft, prompts, block, n)
    rec: dict = {"engine": engine, "server": " ".join(server), "client": " ".join(client)}
    if why is not None:
        return {**rec, "skipped": why}
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{engine}_server.log", "w")
    proc = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not _ready(PORTS[engine], proc, timeout):
            return {**rec, "error": f"the server did not answer within {timeout} s (exit {proc.poll()}); see "
                                    f"{out / f'{engine}_server.log'}"}
        p = subprocess.run(client, capture_output=True, text=True, timeout=timeout)
        (out / f"{engine}_client.log").write_text(p.stdout + p.stderr)
        rec["client_exit"] = p.returncode
        m, t = ACCEPT.search(p.stdout), THROUGHPUT.search(p.stdout)
        rec["accept_length"] = float(m.group(1)) if m else None
        rec["output_tokens_per_s"] = float(t.group(1).replace(",", "")) if t else None
        return rec
    except subprocess.TimeoutExpired:
        return {**rec, "error": f"the client ran past {timeout} s"}
    finally:
        _stop(proc)
        log.close()


def run_all(target: str, draft: str, prompts: str, block: int, n: int, out: Path, timeout: int = 900) -> list[dict]:
    return [run_engine(e, target, draft, prompts, block, n, out, timeout) for e in ENGINES]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF model directory of the target (with its tokenizer)")
    ap.add_argument("--draft", required=True, help="the drafter's export directory")
    ap.add_argument("--prompts", required=True, help='JSONL of {"prompt": ...} records')
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    block = int(json.loads((Path(args.draft) / "config.json").read_text())["dflash_config"]["block_size"])
    recs = run_all(args.target, args.draft, args.prompts, block, args.num_prompts, args.out, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_check.json").write_text(json.dumps(recs, indent=2))
    for r in recs:
        print(f"{r['engine']}: " + (f"skipped: {r['skipped']}" if "skipped" in r else r.get("error") or
                                    f"accept length {r['accept_length']}, {r['output_tokens_per_s']} tok/s"))
    return 0 if all("error" not in r for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
