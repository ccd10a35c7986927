"""The project's training step beside speculators' and SpecForge's own steps: drafter forward + loss + backward.

    python benchmarks/reference_peers.py                                  # all three sizes, 3 timed rounds each
    python benchmarks/reference_peers.py --sizes h512 --repeats 5 --json runs/reference_peers.json
    python benchmarks/reference_peers.py --sizes v248k --repeats 2 --warmup 0     # V 248,320: ~20 s a step
    python benchmarks/reference_peers.py --sizes h512 --profile 12        # + torch.profiler's top ops per way

For each loss kind a peer and the project both have, every way starts from the same drafter weights, context
features, verifier last hidden state, ids, positions and anchors, and runs forward and backward to the drafter's
parameter gradients:

  ce on the verifier's argmax, D-PACE weights, over the scored-slot count (speculators' DFlash defaults; the
  project's objective = "speculators"):
    project loss   the drafter (DFlashDrafter), its own norm, lm_head over its rows, the loss op (ops/torch_impl.loss)
                   on the verifier's logits made as the rewritten graph makes them: the last hidden state gathered
                   at (block position - 1) mod T, the verifier's norm and lm_head on those rows (`--without-rule
                   fuse_heads_into_loss`)
    project fused  the drafter, its own norm, fused_head_loss on the drafter's and the verifier's normed rows
                   (both heads inside the loss, chunk by chunk: the graph as run)
    speculators    speculators 0.9.0 DFlashDraftModel.forward (its backbone, verifier head on the anchored rows,
                   compute_metrics with loss "ce", implementation "eager": its fused losses are Triton kernels, which
                   need a GPU), attention "sdpa" (`--speculators-attn`: its default, flex attention, compiles on CPU)
  ce on the data's next token, no per-slot decay, over the weights' sum (SpecForge's defaults; objective =
  "specforge"):
    project loss / project fused   as above, with labels input_ids[anchor + k] and no verifier head
    specforge      SpecForge 0.2.0 OnlineDFlashModel.forward (its draft model, noise embedding, mask
                   create_dflash_sdpa_mask, labels, weight mask and checkpointed objective chunks of
                   objective_chunk_blocks = 128 blocks, its default), attention "sdpa"

Only anchor selection is bypassed in the peers (speculators' select_anchors, SpecForge's
_sample_anchor_positions return the shared anchors). The packed row is one document (SpecForge's trainer packs
none, so its own mask and positions are then the project's), every block inside it, every slot a loss token: each
peer's loss and gradients must equal the project's for the same objective (reported as dloss and dgrad).

Time: process CPU time (time.process_time) per step, one torch thread by default; `--warmup` untimed rounds, then
`--repeats` rounds, each round every way once (the order rotates each round); the median per way. Peak memory: one
more untimed step of each way under dflash_graph.exec.memtrack.LiveTracker, which counts as torch's MemTracker
does (a TorchDispatchMode charging every new storage until a weakref says it died): the bytes of the storages
created during the step and alive at once, parameter gradients included; weights and inputs, made before, are not
counted. Not RSS: the allocator's cache and the interpreter are outside it.

Not a timed test: tests/test_benchmark_smoke.py (under -m slow) runs the tiny size with one round and checks that
it completes and that the peers' losses and gradients equal the project's; it never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_graph.exec.memtrack import LiveTracker  # noqa: E402
from dflash_graph.models.dflash import DFlashDims  # noqa: E402
from dflash_graph.models.nn.dflash import DFlashDrafter, RMSNorm, slot_valid  # noqa: E402
from dflash_graph.ops import torch_impl as ti  # noqa: E402
from dflash_graph.train.export import export_name  # noqa: E402

# the drafter and its inputs at each size: "tiny" is graphs/tiny.toml's (its target's hidden 128 and vocab 768, its
# drafter's config, T 256, 16 x 4 anchors); the two larger ones the (H 512, T 2,048, 64 x 16 anchors, V 32k
# and V 248,320), with a drafter shaped like the tiny one (2 layers, 2 captured target layers, intermediate 3 H)
SIZES = {
    "tiny": dict(hidden=128, seq=256, anchors=16, block=4, vocab=768, layers=2, intermediate=256, heads=4, kv_heads=2,
                 head_dim=32),
    "h512": dict(hidden=512, seq=2048, anchors=64, block=16, vocab=32000, layers=2, intermediate=1536, heads=8,
                 kv_heads=4, head_dim=64),
    "v248k": dict(hidden=512, seq=2048, anchors=64, block=16, vocab=248320, layers=2, intermediate=1536, heads=8,
                  kv_heads=4, head_dim=64),
}
TARGET_LAYERS = (1, 3)
MASK_ID = 1
# the loss kinds both a peer and the project have: (the project's objective preset, the peer, what it is)
KINDS = {
    "verifier": ("speculators", "speculators", "ce on the verifier's argmax, D-PACE, / scored slots"),
    "data": ("specforge", "specforge", "ce on the data's next token, uniform, / weight sum"),
}


def ctx(params=None, modules=None):
    return types.SimpleNamespace(params=params or {}, module=lambda role: modules[role])


class Case:
    """The shared weights and inputs at one size: a drafter with its own final norm (weights moved off their init),
    the target's frozen embedding, lm_head and final norm, the context features, the verifier's last hidden state,
    ids, positions (one document), the loss mask and sorted anchors whose blocks lie inside the row."""

    def __init__(self, size: str):
        s = SIZES[size]
        self.size, self.s = size, s
        self.H, self.T, self.A, self.B, self.V = s["hidden"], s["seq"], s["anchors"], s["block"], s["vocab"]
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        self.dims = DFlashDims(hidden_size=self.H, intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                               num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                               head_dim=s["head_dim"], rms_norm_eps=1e-6, rope_theta=10000.0, block_size=self.B,
                               mask_token_id=MASK_ID, target_layer_ids=TARGET_LAYERS, target_hidden_size=self.H,
                               vocab_size=self.V)
        self.embed = nn.Embedding(self.V, self.H).requires_grad_(False)
        self.drafter = DFlashDrafter(self.dims, self.embed, own_norm=True)
        self.head = nn.Linear(self.H, self.V, bias=False).requires_grad_(False)
        self.vnorm = RMSNorm(self.H, 1e-6, torch.float32).requires_grad_(False)
        with torch.no_grad():
            for p in self.drafter.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            self.head.weight.normal_(0, 0.3, generator=g)
            self.vnorm.weight.add_(0.1 * torch.randn(self.H, generator=g))
        self.pos = torch.arange(self.T)
        self.ids = torch.randint(2, self.V, (self.T,), generator=g)
        self.loss_mask = torch.ones(self.T, dtype=torch.bool)
        self.loss_mask[0] = False                      # a document's first token is not a loss token
        self.anchors = torch.sort(torch.randperm(self.T - self.B, generator=g)[: self.A] + 1).values
        self.valid = slot_valid(self.loss_mask, self.anchors, self.A, self.B)
        self.index = self.anchors[:, None] + torch.arange(self.B)            # [A, B]
        self.context = torch.randn(self.T, len(TARGET_LAYERS) * self.H, generator=g)
        self.last = torch.randn(self.T, self.H, generator=g)
        self.mods = {"norm": self.vnorm, "lm_head": self.head}

    def inputs(self):
        return [self.pos, self.ids, self.loss_mask, self.anchors, self.valid, self.index, self.context, self.last]


# -- the project's step ------------------------------------------------------------------------------------------

class Project:
    def __init__(self, case: Case, preset: str, fused: bool):
        self.case, self.preset, self.fused = case, preset, fused
        self.model = case.drafter

    def step(self):
        c = self.case
        hidden = c.drafter(c.context, c.ids, c.pos, c.anchors)                   # [A, B, H], before the norm
        x = c.drafter.norm(hidden)
        params = {"objective": self.preset}
        inputs = {"valid": c.valid}
        if self.preset == "specforge":                                          # the data's tokens: no verifier
            inputs["labels"] = ti.gather(ctx({"axis": 0}), c.ids, c.index)["out"]
        else:
            with torch.no_grad():                                               # the rewritten verifier path
                idx = ti.index_shift(ctx({"shift": c.T - 1, "modulo": c.T}), c.index)["out"]
                rows = ti.gather(ctx({"axis": 0}), c.last, idx)["out"]          # [A, B, H]
                tx = ti.norm(ctx(modules=c.mods), rows)["out"]
                if not self.fused:
                    inputs["target"] = ti.lm_head(ctx(modules=c.mods), tx)["logits"]   # [A, B, V]
            if self.fused:
                inputs["target_x"] = tx
        if self.fused:
            out = ti.fused_head_loss(ctx(params, c.mods), x, **inputs)
        else:
            logits = ti.lm_head(ctx(modules=c.mods), x)["logits"]
            out = ti.loss(ctx(params), logits, **inputs)
        out["loss"].backward()
        return out["loss"]


# -- the peers ---------------------------------------------------------------------------------------------------

def peer_available(peer: str) -> tuple[bool, str]:
    mod = {"speculators": "speculators.models.dflash.core",
           "specforge": "specforge.algorithms.common.dflash_family_model"}[peer]
    try:
        __import__(mod)
    except Exception as e:   # noqa: BLE001 (any import failure: say which)
        return False, (f"{peer} could not be imported ({type(e).__name__}: {e}); install the `references` extra: "
                       "pip install --no-deps speculators==0.9.0 specforge==0.2.0 openai sniffio hs-connectors==0.9.0")
    import importlib.metadata as md
    return True, f"{peer} {md.version(peer)}"


def _load(ref: nn.Module, case: Case) -> None:
    sd = {export_name(k): v for k, v in case.drafter.state_dict().items()}
    _, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected


def _qwen3_config(case: Case, **extra):
    from transformers import Qwen3Config

    s = case.s
    return Qwen3Config(vocab_size=case.V, hidden_size=case.H, intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=max(4096, case.T + case.B), **extra)


class Speculators:
    """speculators' DFlashDraftModel.forward with loss "ce" (eager), D-PACE weights, gamma 4, alpha 0.5: its
    DFlash defaults (train/config/schema.py). The target's embedding, lm_head, verifier norm and verifier lm_head
    are the case's own tensors (tied, frozen), so no weight exists twice."""

    def __init__(self, case: Case, attn: str):
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.losses import resolve_loss_config
        from speculators.models.dflash import DFlashSpeculatorConfig, core
        from speculators.proposals.greedy import GreedyTokenProposalConfig

        self.case, self.core = case, core
        tl = _qwen3_config(case)
        tl._attn_implementation = attn
        cfg = DFlashSpeculatorConfig(
            transformer_layer_config=tl, draft_vocab_size=case.V, block_size=case.B,
            aux_hidden_state_layer_ids=list(TARGET_LAYERS), mask_token_id=MASK_ID,
            speculators_config=SpeculatorsConfig(
                algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=case.B - 1)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
        ref = core.DFlashDraftModel(cfg)
        _load(ref, case)
        ref.embed_tokens.weight = case.embed.weight
        ref.lm_head.weight = case.head.weight
        ref.verifier_lm_head.weight = case.head.weight
        ref.verifier_norm.weight = case.vnorm.weight
        self.model = ref
        self.loss_config = resolve_loss_config("ce", "eager")
        doc = torch.cumsum((case.pos == 0).long(), 0)[None]
        self.kw = dict(hidden_states=case.context[None], input_ids=case.ids[None],
                       loss_mask=case.loss_mask[None].long(), verifier_last_hidden_states=case.last[None],
                       document_ids=doc, position_ids=case.pos[None])
        self.anchor_valid = torch.ones(case.A, dtype=torch.bool)

    def step(self):
        c, core = self.case, self.core
        real = core.select_anchors
        core.select_anchors = lambda *a, **k: (c.anchors, self.anchor_valid)    # only anchor selection bypassed
        try:
            _, loss, _ = self.model(**self.kw, loss_config=self.loss_config, gamma=4.0, max_anchors=c.A,
                                    per_position_loss_weight="dpace", dpace_alpha=0.5)
        finally:
            core.select_anchors = real
        loss.backward()
        return loss


class SpecForge:
    """SpecForge's OnlineDFlashModel.forward, loss_type "dflash", no decay, objective_chunk_blocks 128 (its
    config/schema.py defaults), over its DFlashDraftModel; the target's lm_head and embedding are the case's."""

    def __init__(self, case: Case, attn: str):
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel

        self.case = case
        cfg = _qwen3_config(case, num_target_layers=2 * max(TARGET_LAYERS), block_size=case.B,
                            dflash_config={"target_layer_ids": list(TARGET_LAYERS), "mask_token_id": MASK_ID})
        cfg._attn_implementation = attn
        draft = DFlashDraftModel(cfg)
        _load(draft, case)
        self.model = draft
        self.online = OnlineDFlashModel(draft, case.head, case.embed, mask_token_id=MASK_ID, block_size=case.B,
                                        attention_backend=attn, num_anchors=case.A, loss_decay_gamma=None,
                                        objective_chunk_blocks=128, loss_type="dflash")
        keep = torch.ones(1, case.A, dtype=torch.bool)
        # only anchor selection bypassed: the rest of _forward_draft_blocks (noise embedding, positions, its mask)
        # and the objective are SpecForge's
        self.online._sample_anchor_positions = lambda seq_len, loss_mask, device: (case.anchors[None], keep)
        self.args = (case.ids[None], case.context[None], case.loss_mask[None].float())

    def step(self):
        loss, _, _ = self.online(*self.args)
        loss.backward()
        return loss


# -- measuring -----------------------------------------------------------------------------------------------------

def run_step(way) -> tuple[float, dict[str, torch.Tensor]]:
    way.model.zero_grad(set_to_none=True)
    loss = float(way.step().detach())
    name = export_name if isinstance(way, Project) else str     # the peers' names are the export's already
    grads = {name(k): p.grad for k, p in way.model.named_parameters() if p.grad is not None}
    way.model.zero_grad(set_to_none=True)
    return loss, grads


def measure_peak(case: Case, way) -> int:
    tr = LiveTracker()
    for t in case.inputs() + [case.embed.weight, case.head.weight, case.vnorm.weight]:
        tr.adopt(t, "cpu", charge=False)
    for m in {id(case.drafter): case.drafter, id(way.model): way.model}.values():
        for t in list(m.parameters()) + list(m.buffers()):
            tr.adopt(t, "cpu", charge=False)
    way.model.zero_grad(set_to_none=True)
    with tr:
        tr.charge("cpu")
        way.step()
        way.model.zero_grad(set_to_none=True)
    return int(tr.peak["cpu"])


def profile_step(way, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    way.model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        way.step()
    way.model.zero_grad(set_to_none=True)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def bench_kind(case: Case, kind: str, a) -> dict:
    preset, peer, what = KINDS[kind]
    ways = {"project loss": Project(case, preset, fused=False), "project fused": Project(case, preset, fused=True)}
    ok, note = peer_available(peer)
    if ok:
        ways[peer] = (Speculators(case, a.speculators_attn) if peer == "speculators"
                      else SpecForge(case, a.specforge_attn))
    print(f"\n### {case.size}, {kind}: {what} (project objective = {preset!r}; "
          f"peer: {note if ok else 'not run: ' + note})")

    # the same loss and gradients from every way (the peers run their own code on the same case)
    checks = {w: run_step(x) for w, x in ways.items()}
    ref_loss, ref_grads = checks["project loss"]
    agree = {}
    for w, (loss, grads) in checks.items():
        assert set(grads) == set(ref_grads), (w, set(grads) ^ set(ref_grads))
        agree[w] = {"loss": loss, "loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                    "grad_rel_diff": max(_rel(grads[k], ref_grads[k]) for k in grads)}
    del checks
    names = list(ways)
    for _ in range(a.warmup):
        for w in names:
            run_step(ways[w])
    times = {w: [] for w in names}
    for r in range(a.repeats):
        for w in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.process_time()
            run_step(ways[w])
            times[w].append(time.process_time() - t0)
    peaks = {w: measure_peak(case, ways[w]) for w in names}
    res = {"peer": {"name": peer, "ran": ok, "note": note}, "ways": {}}
    for w in names:
        res["ways"][w] = {"cpu_s": times[w], "median_cpu_s": statistics.median(times[w]), "peak_bytes": peaks[w],
                          **agree[w]}
    print("\n| way | median CPU s | CPU s per round | peak MiB | loss | dloss | dgrad |\n"
          "|---|---:|---|---:|---:|---:|---:|")
    for w in names:
        r = res["ways"][w]
        print(f"| {w} | {r['median_cpu_s']:.3f} | {', '.join(f'{t:.3f}' for t in times[w])} | "
              f"{r['peak_bytes'] / 2**20:.1f} | {r['loss']:.6f} | {r['loss_rel_diff']:.1e} | "
              f"{r['grad_rel_diff']:.1e} |")
    if a.profile:
        for w in names:
            print(f"\ntorch.profiler, one step of {w}:\n{profile_step(ways[w], a.profile)}")
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="tiny,h512,v248k", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--kinds", default="verifier,data", help="comma-separated, of " + ", ".join(KINDS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    ap.add_argument("--speculators-attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--specforge-attn", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS", help="also print torch.profiler's top ROWS ops")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    sizes = [s for s in a.sizes.split(",") if s]
    kinds = [k for k in a.kinds.split(",") if k]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r}; expected one of {', '.join(SIZES)}")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"--kinds: unknown kind {k!r}; expected one of {', '.join(KINDS)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"reference peers: torch {torch.__version__}, {torch.get_num_threads()} thread(s), python "
          f"{platform.python_version()}; CPU time = time.process_time per step, median of {a.repeats}; peak = "
          "LiveTracker (storages created during the step, alive at once)")
    res = {"config": {k: v for k, v in vars(a).items() if k != "json"},
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor(),
                       "threads": torch.get_num_threads()},
           "sizes": {}}
    summary = []
    for s in sizes:
        case = Case(s)
        res["sizes"][s] = {"dims": SIZES[s], "kinds": {}}
        for k in kinds:
            r = bench_kind(case, k, a)
            res["sizes"][s]["kinds"][k] = r
            peer = r["peer"]["name"]
            if peer in r["ways"]:
                p = r["ways"][peer]
                for w in ("project loss", "project fused"):
                    x = r["ways"][w]
                    pair = statistics.median(a / b for a, b in zip(x["cpu_s"], p["cpu_s"]))
                    summary.append((s, k, w, peer, x["median_cpu_s"] / p["median_cpu_s"], pair,
                                    x["peak_bytes"], p["peak_bytes"]))
        del case
    if summary:
        print("\n## project / fastest peer (goal: CPU time <= 0.9x at equal or lower peak memory)\n")
        print("| size | loss kind | project way | peer | CPU time / peer | per-round ratio, median | "
              "peak MiB (project / peer) | goal |")
        print("|---|---|---|---|---:|---:|---:|---|")
        for s, k, w, peer, ratio, pair, pk, pp in summary:
            goal = "met" if ratio <= 0.9 and pk <= pp else "not met"
            print(f"| {s} | {k} | {w} | {peer} | {ratio:.3f} | {pair:.3f} | {pk / 2**20:.1f} / {pp / 2**20:.1f} | "
                  f"{goal} |")
        print("(CPU time / peer: the ratio of the medians, which the goal reads; per-round: the median of the ratios "
              "of steps run in the same round, steadier on a loaded machine)")
        res["summary"] = [dict(zip(("size", "kind", "way", "peer", "cpu_ratio", "round_ratio", "peak_bytes",
                                    "peer_peak_bytes"), row)) for row in summary]
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
