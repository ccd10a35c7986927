"""The verifier path: verifier targets + drafter head + loss, forward and backward, four ways in one process.

    python benchmarks/verifier_path.py                                  # T 8,192, 64 x 16 anchors, V 248,320, H 256
    python benchmarks/verifier_path.py --vocab 62080 --repeats 5 --json runs/verifier_path.json
    python benchmarks/verifier_path.py --kind ce                        # the ce peer: torch's F.linear_cross_entropy

Ways (each is what the engine runs for that graph: the ops' own torch functions from ops/torch_impl.py):

  as written  norm and lm_head over every one of the T positions, roll by 1, gather at the anchored block
              positions, the drafter's norm + lm_head, the loss op (graphs/qwen27b.toml as written)
  pushdown    the last hidden state gathered at (block position - 1) mod T first, then norm and lm_head on those
              rows only (after gather_through_remap + gather_through_positionwise; `--without-rule
              fuse_heads_into_loss`)
  fused       fused_head_loss: both heads inside the loss, `--chunk` rows at a time (fuse_heads_into_loss)
  peer        kl / jsd: Liger Kernel's chunked LigerFusedLinearJSDLoss (pure torch, compiled=False: its Triton
              kernels need a GPU), given the same W twice, chunk_size = the fused chunk; it has no per-slot decay
              (rows are masked by label), so its loss value differs. ce: torch's F.linear_cross_entropy with
              LinearCrossEntropyOptions() (chunked), on the verifier's argmax, which the pushdown logits give.
              rkl / tv: no peer computes them.

The drafter is a leaf [anchors, block, hidden] that requires grad (the path starts at its output); the verifier's
last hidden state [T, hidden] comes over the transfer. Every step runs forward and backward (the gradient with
respect to the drafter's rows). Time: `--repeats` rounds after `--warmup`, the ways interleaved in each round
(as written, pushdown, fused, peer, then again), time.perf_counter per step; medians and ratios to "as written".
Peak memory: one more untimed step of each way under dflash_graph.exec.memtrack.LiveTracker (bytes of storages
created during the step alive at once; the inputs and W, made before, are not counted).

Not a timed test: tests/test_benchmark_smoke.py runs it at tiny sizes and checks that the three engine ways give
the same loss and gradient.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.exec.memtrack import LiveTracker  # noqa: E402
from dflash_graph.ops import costs, torch_impl as ti  # noqa: E402


def ctx(params=None, modules=None):
    return types.SimpleNamespace(params=params or {}, module=lambda role: modules[role])


class Setup:
    def __init__(self, a):
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, a.dtype)
        self.T, self.A, self.B, self.H, self.V = a.seq, a.anchors, a.block, a.hidden, a.vocab
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

        self.norm = Qwen3_5RMSNorm(self.H).to(dt)          # the target's final norm (1 + w), shared by the drafter
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(self.H, generator=g) * 0.1)
        self.norm.requires_grad_(False)
        self.head = torch.nn.Linear(self.H, self.V, bias=False).to(dt).requires_grad_(False)   # frozen, shared W
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(self.V, self.H, generator=g, dtype=dt) * (2.0 / math.sqrt(self.H)))
        self.mods = {"norm": self.norm, "lm_head": self.head}
        self.last_hidden = torch.randn(self.T, self.H, generator=g, dtype=dt)
        anchors = torch.sort(torch.randperm(self.T - self.B, generator=g)[: self.A]).values
        self.index = anchors[:, None] + torch.arange(self.B)[None, :]                 # [A, B]
        self.valid = torch.ones(self.A, self.B, dtype=torch.bool)                      # [A, B]: every slot scored
        self.dh = torch.randn(self.A, self.B, self.H, generator=g, dtype=dt).requires_grad_(True)
        self.kind, self.gamma = a.kind, 7.0
        self.chunk = a.chunk or costs.head_chunk(self.A * self.B, self.H, self.V)
        self.loss_chunk = a.loss_chunk
        self.external = [self.last_hidden, self.index, self.valid, self.dh, self.head.weight, self.norm.weight,
                         anchors]

    # -- the ways --------------------------------------------------------------------------------------------
    def _loss(self, s, t):
        return ti.loss(ctx({"kind": self.kind, "gamma": self.gamma, "chunk": self.loss_chunk}), s, t, self.valid)

    def _drafter_logits(self):
        x = ti.norm(ctx(modules=self.mods), self.dh)["out"]
        return ti.lm_head(ctx(modules=self.mods), x)["logits"]

    def as_written(self):
        with torch.no_grad():                                           # the verifier is frozen
            v = ti.norm(ctx(modules=self.mods), self.last_hidden)["out"]
            v = ti.lm_head(ctx(modules=self.mods), v)["logits"]          # [T, V]
            r = ti.roll(ctx({"shift": 1, "axis": 0}), v)["out"]
            del v
            t = ti.gather(ctx({"axis": 0}), r, self.index)["out"]         # [A, B, V]
            del r
        return self._loss(self._drafter_logits(), t)

    def _rows(self):
        idx = ti.index_shift(ctx({"shift": self.T - 1, "modulo": self.T}), self.index)["out"]
        rows = ti.gather(ctx({"axis": 0}), self.last_hidden, idx)["out"]  # [A, B, H]
        return ti.norm(ctx(modules=self.mods), rows)["out"]

    def pushdown(self):
        with torch.no_grad():
            t = ti.lm_head(ctx(modules=self.mods), self._rows())["logits"]   # [A, B, V]
        return self._loss(self._drafter_logits(), t)

    def fused(self):
        with torch.no_grad():
            tx = self._rows()
        x = ti.norm(ctx(modules=self.mods), self.dh)["out"]
        return ti.fused_head_loss(ctx({"kind": self.kind, "gamma": self.gamma, "chunk": self.chunk}, self.mods),
                                  x, tx, self.valid)

    def peer(self):
        x = ti.norm(ctx(modules=self.mods), self.dh)["out"].reshape(-1, self.H)
        with torch.no_grad():
            tx = self._rows().reshape(-1, self.H)
        labels = torch.zeros(self.A * self.B, dtype=torch.long)
        labels.view(self.A, self.B)[:, 0] = -100                          # slot 0 masked, as the loss op does
        if self.kind == "ce":
            with torch.no_grad():
                target = ti.lm_head(ctx(modules=self.mods), tx)["logits"].argmax(-1)   # [rows, V] made here
            target.view(self.A, self.B)[:, 0] = -100
            loss = torch.nn.functional.linear_cross_entropy(x, self.head.weight, target,
                                                            options=torch.nn.LinearCrossEntropyOptions())
        else:
            from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

            beta = {"kl": 0.0, "jsd": 0.5}[self.kind]
            f = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, compiled=False,
                                        chunk_size=self.chunk)
            loss = f(x, self.head.weight, tx, self.head.weight, labels)
        return {"loss": loss}


def peer_available(kind: str) -> tuple[bool, str]:
    if kind == "ce":
        import torch.nn.functional as F
        ok = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
        return ok, ("torch F.linear_cross_entropy (chunked, LinearCrossEntropyOptions)" if ok else
                    f"torch {torch.__version__} has no F.linear_cross_entropy")
    if kind in ("kl", "jsd"):
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss  # noqa: F401
        except Exception as e:   # noqa: BLE001 (any import failure: say which)
            return False, f"Liger Kernel's chunked LigerFusedLinearJSDLoss could not be imported: {type(e).__name__}: {e}"
        return True, ("Liger Kernel chunked LigerFusedLinearJSDLoss (torch, compiled=False; beta "
                      f"{ {'kl': 0.0, 'jsd': 0.5}[kind]}; its Triton LigerFusedLinearJSD needs a GPU and was not run)")
    return False, f"no peer computes the {kind} loss of two heads"


def step(setup: Setup, way: str):
    setup.dh.grad = None
    out = getattr(setup, way)()
    out["loss"].backward()
    loss = float(out["loss"].detach())
    grad = setup.dh.grad
    setup.dh.grad = None
    return loss, grad


def measure_peak(setup: Setup, way: str) -> int:
    tr = LiveTracker()
    for t in setup.external:
        tr.adopt(t, "cpu", charge=False)
    with tr:
        tr.charge("cpu")
        loss, grad = step(setup, way)
        del grad
    return int(tr.peak["cpu"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192, help="T: positions of the verifier's last hidden state")
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--kind", default="kl", choices=("ce", "kl", "rkl", "jsd", "tv"))
    ap.add_argument("--chunk", type=int, default=0, help="fused rows per chunk (0: Liger's rule, ops/costs.head_chunk)")
    ap.add_argument("--loss-chunk", type=int, default=0, help="the loss op's chunk (0: its default, ops/costs.loss_chunk)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    ap.add_argument("--ways", default="as_written,pushdown,fused,peer")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    s = Setup(a)
    ways = [w for w in a.ways.split(",") if w]
    ok, peer_note = peer_available(a.kind)
    if "peer" in ways and not ok:
        ways.remove("peer")
    print(f"verifier path, T={s.T:,} anchors x block={s.A} x {s.B} ({s.A * s.B:,} rows) V={s.V:,} H={s.H} {a.dtype} "
          f"kind={a.kind}; fused chunk {s.chunk} rows; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"peer: {'ran: ' if ok else 'not run: '}{peer_note}")

    # the same loss and gradient from the engine's three ways (the peer computes its own loss)
    checks = {w: step(s, w) for w in ways}
    ref_loss, ref_grad = checks[ways[0]]
    agree = {}
    for w, (loss, grad) in checks.items():
        agree[w] = {"loss": loss, "loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                    "grad_rel_diff": float((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-30))}
    del checks
    for _ in range(a.warmup):
        for w in ways:
            step(s, w)
    times = {w: [] for w in ways}
    for _ in range(a.repeats):
        for w in ways:
            t0 = time.perf_counter()
            step(s, w)
            times[w].append(time.perf_counter() - t0)
    peaks = {w: measure_peak(s, w) for w in ways}
    base = ways[0]
    res = {"config": {k: v for k, v in vars(a).items() if k != "json"} | {"chunk": s.chunk},
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor(),
                       "threads": torch.get_num_threads()},
           "peer": {"ran": ok, "note": peer_note},
           "ways": {}}
    print(f"\n{'way':<11} {'peak MiB':>10} {'peak / ' + base:>18} {'median s':>9} {'time / ' + base:>18} "
          f"{'loss':>12} {'dloss':>9} {'dgrad':>9}")
    for w in ways:
        med = statistics.median(times[w])
        r = {"peak_bytes": peaks[w], "peak_ratio": peaks[w] / peaks[base], "times_s": times[w], "median_s": med,
             "time_ratio": med / statistics.median(times[base]), **agree[w]}
        res["ways"][w] = r
        print(f"{w:<11} {peaks[w] / 2**20:>10.1f} {r['peak_ratio']:>18.4f} {med:>9.3f} {r['time_ratio']:>18.3f} "
              f"{r['loss']:>12.6f} {r['loss_rel_diff']:>9.1e} {r['grad_rel_diff']:>9.1e}")
    pairs = [("pushdown", "as_written"), ("fused", "pushdown"), ("fused", "peer")]
    res["ratios"] = {}
    for x, y in pairs:
        if x in res["ways"] and y in res["ways"]:
            pr = res["ways"][y]["peak_bytes"] / res["ways"][x]["peak_bytes"]
            tr = res["ways"][x]["median_s"] / res["ways"][y]["median_s"]
            res["ratios"][f"{x}_vs_{y}"] = {"peak_less_x": pr, "time_ratio": tr}
            print(f"{x} vs {y}: {pr:.2f}x less peak memory, {tr:.3f}x the time")
    print("(dloss, dgrad: relative difference of the loss and of d loss / d drafter rows from the first way; the "
          "peer's loss is its own definition)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
