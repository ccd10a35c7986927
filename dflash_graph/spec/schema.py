"""The TOML format, declared once: the loader validates against it, docs/toml-reference.md is generated from it
(tools/gen_docs.py, checked by a test), and the JSON Schema (a later issue) will be derived from it."""

from __future__ import annotations

import attrs


@attrs.frozen
class Key:
    name: str
    kind: str  # str | int | float | bool | size | dim | list[str] | list[int] | table | any | str|table | list|table
    doc: str
    required: bool = False
    default: object = None
    choices: tuple[str, ...] = ()
    # bounds of a number (of each element of a list of numbers; of a size in bytes), checked by the loader
    low: float | None = None
    high: float | None = None
    open_low: bool = False       # low itself is not allowed (lr > 0)
    open_high: bool = False

    def bounds_text(self) -> str:
        lo = "" if self.low is None else f"{_num(self.low)} {'<' if self.open_low else '<='} "
        hi = "" if self.high is None else f" {'<' if self.open_high else '<='} {_num(self.high)}"
        return f"{lo}{self.name}{hi}" if lo or hi else ""


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


@attrs.frozen
class Section:
    name: str            # TOML path as written: "graph", "devices.<name>", "nodes[]"
    doc: str
    keys: tuple[Key, ...] = ()
    open: bool = False   # free-form keys (dims, groups, model config)

    def key(self, name: str) -> Key | None:
        return next((k for k in self.keys if k.name == name), None)

    @property
    def key_names(self) -> list[str]:
        return [k.name for k in self.keys]


GRAPH = Section("graph", "What the graph is.", (
    Key("name", "str", "Short name shown in reports."),
    Key("description", "str", "Free text."),
))

DIMS = Section("dims", "Named symbolic sizes. A value is a positive integer or an expression string over other "
               "dims and model config values: `tokens = \"anchors * block\"`, `hidden = \"target.hidden_size\"`. "
               "Operators: + - * // % ** min() max().", open=True)

DEVICE = Section("devices.<name>", "A physical device. The name is what nodes and groups refer to.", (
    Key("torch", "str", "The torch device it maps to: `cuda:3`, `cpu`.", required=True),
    Key("capacity", "size", "Total memory, e.g. \"94.97 GiB\" (what torch.cuda.mem_get_info reports as total).", required=True),
    Key("outside_allocator", "size", "Memory not available to tensors: CUDA context, cuBLAS/NCCL workspaces, "
        "other processes.", default="0 B"),
))

GROUPS = Section("groups", "Device groups for replicated nodes: `targets = [\"gpu0\", \"gpu1\"]`. A node on a group "
                 "runs once per device of the group, each replica on its own data.", open=True)

MEMORY = Section("memory", "How memory is predicted.", (
    Key("expandable_segments", "bool", "Simulate PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.", default=False),
    Key("max_split_size", "size", "Simulate PYTORCH_CUDA_ALLOC_CONF max_split_size_mb; at least 20 MiB, as PyTorch "
        "requires (AllocatorConfig.cpp, parseMaxSplitSize).", default=None, low=20 * 2**20),
))

MODEL = Section("models.<name>", "A model whose weights nodes use.", (
    Key("arch", "str", "Architecture (see \"Model configs by arch\" below).", required=True),
    Key("config", "str|table", "The model config: a path to a config.json (relative to this file) or an inline "
        "table of config keys. String values that are dim expressions are evaluated (`vocab_size = \"vocab\"`).",
        required=True),
    Key("dtype", "str", "Parameter and activation dtype.", default="bfloat16",
        choices=("float32", "bfloat16", "float16", "float64")),
    Key("trainable", "bool", "Train this model (gradients and AdamW state are counted) or keep it frozen.", default=False),
    Key("weights", "str", "Local path to weights (a directory for from_pretrained or a .safetensors file). "
        "Absent: random initialisation."),
    Key("shares", "table", "Components taken from another model: `{ embed = \"target.embed\", norm = "
        "\"target.norm\", lm_head = \"target.lm_head\" }`. Shared tensors are frozen and counted once per device."),
))

NODE = Section("nodes[]", "One node of the graph (an array of tables: `[[nodes]]`).", (
    Key("id", "str", "Unique id; outputs are referred to as `id.output`.", required=True),
    Key("op", "str", "Node kind (see docs/ops.md).", required=True),
    Key("inputs", "list|table", "Inputs by `node.output`: a table `{ x = \"norm.out\" }` or a list in the op's input order.",
        default={}),
    Key("params", "table", "Op parameters (see docs/ops.md).", default={}),
    Key("device", "str", "A device name or group name.", required=True),
    Key("model", "str", "The model whose weights this node uses (for ops that use one)."),
))

TRAIN = Section("train", "Training settings for `dflash-graph run`.", (
    Key("steps", "int", "Optimizer steps (at least 1).", default=100, low=1, high=10**9),
    Key("lr", "float", "Peak learning rate (AdamW), above 0 and at most 1.", default=3e-4, low=0, open_low=True, high=1),
    Key("warmup_steps", "int", "Linear warmup steps.", default=10, low=0, high=10**9),
    Key("weight_decay", "float", "AdamW weight decay.", default=0.0, low=0, high=10),
    Key("betas", "list[float]", "AdamW betas: two numbers in [0, 1).", default=[0.9, 0.95], low=0, high=1,
        open_high=True),
    Key("grad_clip", "float", "Clip the global gradient norm to this value (above 0).", default=1.0, low=0,
        open_low=True, high=1e9),
    Key("grad_accum", "int", "Micro-batches per optimizer step.", default=1, low=1, high=10**4),
    Key("seed", "int", "Seed for initialisation, data order and anchor sampling.", default=0, low=0, high=2**63 - 1),
    Key("log_every", "int", "Steps between progress lines.", default=1, low=1, high=10**9),
    Key("checkpoint_every", "int", "Steps between checkpoints (0: only at the end of the run).", default=50, low=0,
        high=10**9),
    Key("keep_checkpoints", "int", "How many of the latest checkpoints a run keeps (older ones are deleted).",
        default=3, low=1, high=1000),
))

DATA = Section("data", "Training data for `dflash-graph run`.", (
    Key("corpus", "str", "JSONL file with a `text` field per line (relative to this file).", required=True),
    Key("tokenizer", "str", "Local tokenizer: a tokenizer.json or a directory (relative to this file).", required=True),
    Key("text_key", "str", "Field of each JSONL object that holds the text.", default="text"),
))

TOP = Section("(top level)", "The sections of a graph file.", (
    Key("graph", "table", "See [graph]."),
    Key("dims", "table", "See [dims].", required=True),
    Key("devices", "table", "See [devices.<name>].", required=True),
    Key("groups", "table", "See [groups]."),
    Key("memory", "table", "See [memory]."),
    Key("models", "table", "See [models.<name>]."),
    Key("nodes", "list", "See [[nodes]].", required=True),
    Key("train", "table", "See [train]."),
    Key("data", "table", "See [data]."),
))

SECTIONS = (TOP, GRAPH, DIMS, DEVICE, GROUPS, MEMORY, MODEL, NODE, TRAIN, DATA)
