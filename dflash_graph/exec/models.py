"""The torch modules a graph's nodes use, built once per (model, torch device).

A target (any arch the registry marks `target`: models/registry.py) is built whole, through transformers' own
causal-LM class, where a forward runs on it; a device that needs only some of its components
(the drafter device needs the target's embedding, final norm and lm_head) gets copies of those modules. A model
that shares components (`shares`) uses the owner's modules, frozen.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

from ..analysis.infer import Typed
from ..errors import GraphError, Problem
from ..models.registry import ARCHS
from ..ops import registry

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class _KernelFallbackNote(logging.Filter):
    """transformers warns, once per kernel and process, that Qwen3.5's Gated DeltaNet falls back to PyTorch's
    reference code. Which kernels a model runs on is decided when the graph is checked (the model's
    `linear_kernels`, by default what is installed: models/qwen3_5.py `installed_linear_kernels`) and check's
    report says it; `run` and `eval` say more only when what runs here differs from what check assumed
    (`kernel_notes`, printed once, by the process that prints the report). So the warning is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


def _quiet_kernel_fallbacks() -> None:
    lg = logging.getLogger("transformers.integrations.hub_kernels")
    if not any(isinstance(f, _KernelFallbackNote) for f in lg.filters):
        lg.addFilter(_KernelFallbackNote())


def _weights_error(e: Exception, model: str, weights: Path, loc) -> Exception:
    """The user's weights file that cannot be read, or that does not fit the model's config, as a located error;
    any other exception as it is."""
    from safetensors import SafetensorError

    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    if isinstance(e, (SafetensorError, OSError)):
        return GraphError(Problem(f"the weights of model '{model}' cannot be read: {weights}: {first}", loc,
                                  hint="a .safetensors file, or a directory with model.safetensors (or a sharded "
                                       "model.safetensors.index.json), relative to the graph file"))
    if isinstance(e, (ValueError, RuntimeError)):   # keys or shapes that the config's model does not have
        return GraphError(Problem(f"the weights of model '{model}' do not fit its config: {first}", loc,
                                  hint=f"use the weights that belong to models.{model}.config (the config.json "
                                       "beside them)"))
    return e


class ModelStore:
    def __init__(self, typed: Typed, torch_device: dict[str, str], seed: int = 0):
        self.typed = typed
        self.torch_device = torch_device
        self.seed = seed
        self._full: dict[tuple[str, str], nn.Module] = {}
        self._parts: dict[tuple[str, str, str], nn.Module] = {}
        # NOTE [Heads only]: True where no target body runs in this process (run --hidden-states): a target's
        # embedding, final norm and lm_head are read alone from its weights (models/nn/target.build_target_heads);
        # a target without weights (random initialisation) is still built whole, to draw the same values
        self.heads_only = False
        self.drafters: dict[str, nn.Module] = {}   # model name -> the trainable module
        # model name -> its data-parallel wrapper (DistributedDataParallel), which the trainable role's forward goes
        # through under torchrun, so that its gradients are averaged over the model's ranks (train/trainer.py)
        self.wrapped: dict[str, nn.Module] = {}
        base = typed.ctx.spec.file
        self.base = Path(base).parent if base else Path(".")

    # -- a target (ARCHS[arch].target) ----------------------------------------------------------------------
    def full(self, model: str, tdev: str) -> nn.Module:
        key = (model, tdev)
        if key not in self._full:
            from ..models.nn.target import build_target

            m = self.typed.ctx.models[model]
            weights = m.spec.weights
            if weights is not None:
                weights = self.base / weights
                if not weights.exists():
                    raise GraphError(Problem(f"weights for model '{model}' not found: {weights}",
                                             self.typed.ctx.spec.loc("models", model, "weights"),
                                             hint="a local directory or .safetensors file, relative to the graph file"))
            _quiet_kernel_fallbacks()
            torch.manual_seed(self.seed)
            impl = getattr(m.dims, "attn_implementation", "sdpa")   # the forward the graph declares (check predicts it)
            if impl == "flash_attention_2" and not str(tdev).startswith("cuda"):
                raise GraphError(Problem(f"model '{model}' declares attn_implementation = \"flash_attention_2\", "
                                         f"which needs a CUDA device; it would run on {tdev}",
                                         self.typed.ctx.spec.loc("models", model, "attn_implementation"),
                                         hint="declare \"sdpa\" or \"eager\" (packing = \"mask\") for a CPU run"))
            try:
                built = build_target(dict(m.config), weights, DTYPES[m.spec.dtype], tdev, attn_implementation=impl,
                                     arch=m.spec.arch)
            except Exception as e:
                if weights is None:
                    raise
                raise _weights_error(e, model, weights, self.typed.ctx.spec.loc("models", model, "weights")) from None
            built.dflash_packing = getattr(m.dims, "packing", "documents")
            built.requires_grad_(False)
            self._full[key] = built
        return self._full[key]

    def _target_part(self, model: str, comp: str, tdev: str) -> nn.Module:
        from ..models.nn.target import embedding, final_norm, lm_head

        pick = {"embed": embedding, "norm": final_norm, "lm_head": lm_head}[comp]
        if (model, tdev) in self._full:
            return pick(self._full[(model, tdev)])
        key = (model, comp, tdev)
        m = self.typed.ctx.models[model]
        if key not in self._parts and self.heads_only and m.spec.weights is not None:
            from ..models.nn.target import build_target_heads

            weights = self.base / m.spec.weights
            try:
                heads = build_target_heads(dict(m.config), weights, DTYPES[m.spec.dtype], tdev, arch=m.spec.arch)
            except Exception as e:
                raise _weights_error(e, model, weights, self.typed.ctx.spec.loc("models", model, "weights")) from None
            for c, part in (("embed", embedding), ("norm", final_norm), ("lm_head", lm_head)):
                self._parts[(model, c, tdev)] = part(heads)
        if key not in self._parts:
            src = next((m for (name, _), m in self._full.items() if name == model), None)
            if src is None:
                src = self.full(model, "cpu") if tdev != "cpu" else self.full(model, tdev)
                if tdev == "cpu":
                    return pick(src)
            self._parts[key] = copy.deepcopy(pick(src)).to(tdev)
        return self._parts[key]

    # -- any component ---------------------------------------------------------------------------------------
    def component(self, model: str, comp: str, tdev: str) -> nn.Module:
        info = self.typed.ctx.models[model]
        owner, ocomp = info.component_owner(comp).split(".")
        oinfo = self.typed.ctx.models[owner]
        if ARCHS[oinfo.spec.arch].target:
            return self._target_part(owner, ocomp, tdev)
        if ARCHS[oinfo.spec.arch].trains:
            d = self.drafter(owner, tdev)
            return d.norm if ocomp == "norm" else d     # the drafter's own final norm, where it has one
        raise KeyError(comp)

    def drafter(self, model: str, tdev: str, published: bool = True) -> nn.Module:
        """The trainable module, built on first use (from its published `weights` when it declares them;
        `published=False`: not read, for a module whose weights are loaded next anyway)."""
        if model not in self.drafters:
            from ..models.nn.dflash import DFlashDrafter

            info = self.typed.ctx.models[model]
            embed = self.component(model, "embed", tdev)
            torch.manual_seed(self.seed + 1)
            # NOTE [Trainable memory] (analysis/memory.py): the module computes in the model dtype; the trainer
            # keeps fp32 masters for AdamW when that dtype is not float32.
            d = DFlashDrafter(info.dims, embed, dtype=DTYPES[info.spec.dtype],
                              own_norm=info.component_owner("norm") == f"{model}.norm").to(tdev)
            if info.spec.weights is not None and published:
                self._load_published(model, d, tdev)
            d.train()
            self.drafters[model] = d
        return self.drafters[model]

    def _load_published(self, model: str, drafter: nn.Module, tdev: str) -> None:
        """Start `drafter` from the published DFlash draft checkpoint its `weights` name (z-lab's, speculators'
        or `export`'s format: models/published.py; check has compared its config and shapes with the graph's).
        Tensors are matched by name: every one of the module's, its own final norm too where it has one. Where it
        has none (it trains through the target's frozen norm), the checkpoint's `norm.weight` must be the plain
        form of that norm, as `export` writes it: a drafter trained with a norm of its own would otherwise start
        from other logits than its checkpoint's."""
        from safetensors import SafetensorError, safe_open

        from ..models import published

        info = self.typed.ctx.models[model]
        loc = self.typed.ctx.spec.loc("models", model, "weights")
        path = self.base / info.spec.weights
        if not path.exists():
            raise GraphError(Problem(f"weights for model '{model}' not found: {path}", loc,
                                     hint="a DFlash draft directory (config.json + model.safetensors), relative to "
                                          "the graph file"))
        try:
            ck = published.read(path)
        except published.CheckpointError as e:
            raise GraphError(Problem(f"model '{model}' cannot start from {path}: {e}", loc, hint=e.hint)) from None
        own = drafter.state_dict()
        loaded: dict[str, torch.Tensor] = {}
        try:
            for f in ck.files:
                with safe_open(str(f), "pt") as fh:
                    for name in fh.keys():     # noqa: SIM118 (safe_open is not a mapping)
                        mine = published.import_name(name)
                        if mine in own or mine == published.NORM:
                            loaded[mine] = fh.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise _weights_error(e, model, path, loc) from None
        norm = loaded.pop(published.NORM, None) if published.NORM not in own else None
        try:
            drafter.load_state_dict({k: v.to(own[k].dtype) for k, v in loaded.items() if k in own}, strict=True)
        except RuntimeError as e:
            raise _weights_error(e, model, path, loc) from None
        if norm is not None:
            owner = info.component_owner("norm").split(".")[0]
            w = self.component(model, "norm", tdev).weight.detach().to("cpu", torch.float32)
            plus_one = ARCHS[self.typed.ctx.models[owner].spec.arch].norm_plus_one
            plain = (1.0 + w if plus_one else w).to(norm.dtype)
            if plain.shape != norm.shape or not torch.equal(plain, norm):
                diff = (f"{(plain.float() - norm.float()).abs().max().item():.3g}" if plain.shape == norm.shape
                        else f"shape {list(norm.shape)}")
                raise GraphError(Problem(
                    f"model '{model}' trains through the frozen final norm of model '{owner}', but the checkpoint "
                    f"{ck.path} was trained with a final norm of its own (its norm.weight differs from that norm "
                    f"by {diff}): the drafter would not start from the checkpoint's logits", loc,
                    expected=f"norm.weight = the final norm of '{owner}'{' (1 + w)' if plus_one else ''}, as "
                             "`dflash-graph export` writes it", actual="a norm.weight trained with the drafter",
                    hint="give the drafter a trainable final norm of its own (docs/drafter.md, \"The final "
                         "norm\"), or start from a checkpoint trained through the target's norm"))

    def module(self, node, role: str, tdev: str) -> nn.Module:
        """The module a node asks for by role (its op's Traits.modules, ops/contract.py): "body" (the model
        built whole), "trainable" (the model's trainable module) or a component name."""
        if role == "body":
            return self.full(node.model, tdev)
        if role == "trainable":
            return self.wrapped.get(node.model) or self.drafter(node.model, tdev)
        return self.component(node.model, role, tdev)

    def resident(self, node, role: str, tdev: str) -> list[torch.Tensor]:
        """The tensors a role's module keeps on the device, as the memory model charges them: the body of a
        model built whole (its lm_head is charged where an lm_head node uses it), a trainable module with the
        embedding it borrows, a component's parameters and buffers."""
        mod = self.drafter(node.model, tdev) if role == "trainable" else self.module(node, role, tdev)
        if role == "body":
            mod = mod.model
        tensors = list(mod.parameters()) + list(mod.buffers())
        if role == "trainable":
            tensors.append(mod.embed.weight)
        # a sharded drafter's parameters (FSDP2 DTensors): the shard this process holds
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]

    def drop_unused_heads(self) -> None:
        """A full model whose lm_head no node on that torch device uses does not keep it (after the rewrite that
        drops the targets' logits, the targets hold the body only, as check predicted)."""
        used = set()
        for n in self.typed.graph.nodes:
            op = registry.get(n.op)
            if n.model and "lm_head" in op.components:
                owner = self.typed.ctx.models[n.model].component_owner("lm_head").split(".")[0]
                for dev in self.typed.ctx.devices_of(n.device):
                    used.add((owner, self.torch_device[dev]))
        for (model, tdev), m in self._full.items():
            if (model, tdev) not in used and getattr(m, "lm_head", None) is not None:
                m.lm_head = None

    def on_one_device(self, tdev: str) -> ModelStore:
        """A store that runs every logical device of the graph on the torch device `tdev`, holding the targets this
        store built there (the same modules, not copies) and no drafter yet: the held-out evaluation under
        torchrun runs the whole graph beside a target replica with it (train/heldout.py)."""
        s = ModelStore(self.typed, {d: tdev for d in self.typed.ctx.spec.devices}, self.seed)
        s.heads_only = self.heads_only
        s._full = {k: m for k, m in self._full.items() if k[1] == tdev}
        return s

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for d in self.drafters.values() for p in d.parameters() if p.requires_grad]

    def preload(self, local: frozenset[str] | None = None) -> None:
        """Build every module the graph's nodes use on the `local` devices (all by default), before the first step
        (so step 1 measures steady state)."""
        for n in self.typed.graph.nodes:
            if not n.model:
                continue
            for dev in self.typed.ctx.devices_of(n.device):
                if local is not None and dev not in local:
                    continue
                for role in registry.get(n.op).module_roles():     # declared by the op (Traits.modules)
                    self.module(n, role, self.torch_device[dev])
        self.drop_unused_heads()
