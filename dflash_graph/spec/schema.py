"""The TOML format, declared once: the loader validates against it, and docs/toml-reference.md and the JSON Schema
for editors (docs/graph.schema.json, `json_schema`) are generated from it (tools/gen_docs.py, checked by tests)."""

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
    # a path (relative to the graph file) that the named command reads: check reports one that does not exist
    # (spec/paths.py), run refuses it before any work, `plan --emit` rewrites it relative to the file it writes
    path: str | None = None

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
    Key("outside_allocator", "size", "Memory not available to tensors: CUDA context, cuBLAS workspaces, "
        "other processes (NCCL's buffers are [launch] nccl_memory_per_peer).", default="0 B"),
    Key("rank", "int", "The torchrun rank (process) that owns this device. Absent on every device: one rank per "
        "device, in the order of [devices]. Several devices may share a rank (two CPU replicas in one process)."),
    Key("throughput", "str", "Sustained compute of this device, e.g. \"400 TFLOP/s\": check predicts each "
        "device's busy time per step from the ops' FLOPs and names the bottleneck. Say where the figure comes from "
        "in a comment."),
    Key("node", "int", "The machine (torchrun node) this device is on: collectives between devices of one node run "
        "at [launch] intra_node_bandwidth, across nodes at inter_node_bandwidth. Absent: 0 (one machine).",
        default=0, low=0, high=10**6),
))

LAUNCH = Section("launch", "How `torchrun -m dflash_graph run` runs the graph, one process per rank "
                 "(docs/distributed.md).", (
    Key("nccl_memory_per_peer", "size", "GPU memory NCCL keeps outside PyTorch's allocator for each other rank a "
        "CUDA device sends to or receives from (its p2p connection buffers). Added to the device's "
        "outside_allocator when the device talks to another rank.", default="256 MiB"),
    Key("stall_timeout", "float", "Seconds a rank waits on a send or receive before it calls the peer stalled "
        "and stops the run.", default=30.0),
    Key("backend", "str", "torch.distributed backend: `auto` picks nccl when every device is CUDA, gloo when "
        "every device is a CPU.", default="auto", choices=("auto", "gloo", "nccl")),
    Key("intra_node_bandwidth", "str", "Link bandwidth per device for collectives between devices of one node, "
        "e.g. \"450 GB/s\": check times a data-parallel model's all-reduce (DDP) or all-gather and reduce-scatter "
        "(FSDP) with it (docs/distributed.md, \"Layouts\"). The default is NVLink 4's 450 GB/s per direction "
        "(H100/H200 SXM: 900 GB/s bidirectional): a declared figure, not measured.", default="450 GB/s"),
    Key("inter_node_bandwidth", "str", "Link bandwidth per device for collectives that cross nodes (a group whose "
        "devices declare different `node`). The default is one 400 Gb/s InfiniBand NDR port per GPU, 50 GB/s: a "
        "declared figure, not measured.", default="50 GB/s"),
))

GROUPS = Section("groups", "Device groups for replicated nodes: `targets = [\"gpu0\", \"gpu1\"]`. A node on a group "
                 "runs once per device of the group, each replica on its own data.", open=True)

MEMORY = Section("memory", "How memory is predicted.", (
    Key("expandable_segments", "bool", "Simulate PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.", default=False),
    Key("max_split_size", "size", "Simulate PYTORCH_CUDA_ALLOC_CONF max_split_size_mb; at least 20 MiB, as PyTorch "
        "requires (AllocatorConfig.cpp, parseMaxSplitSize).", default=None, low=20 * 2**20),
    Key("host_memory", "size", "Memory of the host the CPU devices share (those with torch = \"cpu\", and those "
        "mapped there by --device-map): check adds up their peaks and predicts an OOM when the sum exceeds it; a "
        "device mapped to the CPU gets it as its capacity. Absent: what the host running check has available "
        "(MemAvailable in /proc/meminfo). The flag --host-memory sets it.", default=None),
))

MODEL = Section("models.<name>", "A model whose weights nodes use.", (
    Key("arch", "str", "Architecture (see \"Model configs by arch\" below). Absent: the target arch whose configs "
        "carry the config's `model_type` (`qwen3`, `llama`, `qwen3_moe`; `qwen3_5`, `qwen3_5_text` -> `qwen3_5`); a drafter "
        "declares `dflash`. A "
        "declared arch must match the config's `model_type`, and a config.json file must name one "
        "(docs/guide.md, \"Supported targets\")."),
    Key("config", "str|table", "The model config: a path to a config.json (relative to this file) or an inline "
        "table of config keys. String values that are dim expressions are evaluated (`vocab_size = \"vocab\"`).",
        required=True),
    Key("dtype", "str", "Parameter and activation dtype.", default="bfloat16",
        choices=("float32", "bfloat16", "float16", "float64")),
    Key("trainable", "bool", "Train this model (gradients and AdamW state are counted) or keep it frozen. Only a "
        "dflash drafter trains; `trainable = true` on a target is refused.", default=False),
    Key("weights", "str", "A target: local path to weights (a directory for from_pretrained or a .safetensors file), "
        "relative to this file. A dflash drafter: the DFlash draft checkpoint it starts from (a directory of "
        "config.json + model.safetensors in the format `export` and z-lab write, or in speculators' format; or its "
        ".safetensors file); check compares its block size, target layers, mask token, shapes and target depth "
        "with the graph's (docs/drafter.md, \"Fine-tuning a published drafter\"). Absent: random initialisation "
        "(`run --resume` continues a run).", path="run"),
    Key("shares", "table", "Components taken from another model: `{ embed = \"target.embed\", norm = "
        "\"target.norm\", lm_head = \"target.lm_head\" }`. Shared tensors are frozen and counted once per device."),
    Key("attn_implementation", "str", "A target: transformers' attention implementation for this model's forward "
        "(absent: sdpa, transformers' default). qwen3, llama and qwen3_moe: sdpa (their memory programs are "
        "derived for it); qwen3_5: any of these.", choices=("sdpa", "flash_attention_2", "eager")),
    Key("packing", "str", "A target: how a packed sequence reaches the forward: `documents` (one forward per "
        "document, what `run` does; absent = this), `mask` (one forward over the packed row: sdpa and eager build a "
        "dense [seq, seq] mask), `cu_seqlens` (one forward, flash_attention_2's varlen path; qwen3_5 only).",
        choices=("documents", "mask", "cu_seqlens")),
    Key("linear_kernels", "str", "qwen3_5: the Gated DeltaNet kernels: `torch` (transformers' reference code) or "
        "`fla` (flash-linear-attention + causal-conv1d). Absent: what is installed where `check` runs.",
        choices=("torch", "fla")),
    Key("parallel", "str", "A trainable model only: train it data-parallel over the devices of the group its nodes "
        "are placed on, one replica per device (each on its own data shard and anchors, one optimizer step per "
        "global batch): `ddp` (DistributedDataParallel: every device holds the whole model, its gradients and "
        "AdamW state) or `fsdp` (FSDP2's fully_shard: each of M devices holds 1/M of them). Replica r of a "
        "group of N feeds the model's replica r mod M. Absent: the model trains on one device.",
        choices=("ddp", "fsdp")),
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
    Key("steps", "int", "Optimizer steps (at least 1; `run --steps` overrides it). The learning-rate schedule ends "
        "at the run's last step; a resume takes the run's steps from its checkpoint, and only `--steps` changes "
        "them.", default=100, low=1, high=10**9),
    Key("lr", "float", "Peak learning rate (AdamW), above 0 and at most 1.", default=3e-4, low=0, open_low=True, high=1),
    Key("warmup_steps", "int", "Linear warmup steps; then a cosine down to 10% of lr at the run's last step.",
        default=10, low=0, high=10**9),
    Key("weight_decay", "float", "AdamW weight decay.", default=0.0, low=0, high=10),
    Key("betas", "list[float]", "AdamW betas: two numbers in [0, 1).", default=[0.9, 0.95], low=0, high=1,
        open_high=True),
    Key("grad_clip", "float", "Clip the global gradient norm to this value (above 0).", default=1.0, low=0,
        open_low=True, high=1e9),
    Key("max_nonfinite_steps", "int", "Stop the run (exit 2) after this many steps in a row whose loss or gradient "
        "norm is NaN or infinite. Such a step is skipped: no weight or optimizer state changes, the learning-rate "
        "schedule still advances, and metrics.jsonl records it with `\"skipped\"`.", default=3, low=1, high=10**6),
    Key("grad_accum", "int", "Micro-batches per optimizer step.", default=1, low=1, high=10**4),
    Key("seed", "int", "Seed for initialisation, data order and anchor sampling.", default=0, low=0, high=2**63 - 1),
    Key("log_every", "int", "Steps between progress lines.", default=1, low=1, high=10**9),
    Key("checkpoint_every", "int", "Steps between checkpoints (0: only at the end of the run).", default=50, low=0,
        high=10**9),
    Key("keep_checkpoints", "int", "How many of the latest checkpoints a run keeps (older ones are deleted).",
        default=3, low=1, high=1000),
    Key("eval_every", "int", "Steps between evaluations on the held-out split ([data] holdout), and one at the end "
        "(0: none).", default=0, low=0, high=10**9),
    Key("eval_batches", "int", "Packed sequences of the held-out split per evaluation (per replica).", default=4,
        low=1, high=10**6),
    Key("threads", "int", "torch CPU threads (0: one per replica's share of the cores; torch's default oversubscribes "
        "a loaded machine).", default=0, low=0, high=4096),
))

DATA = Section("data", "Training data for `dflash-graph run` (formats and errors: docs/drafter.md, \"Data\").", (
    Key("corpus", "str", "The corpus (relative to this file): a JSONL file (text or chat records, or pre-tokenized "
        "`input_ids`), a Parquet file, or a Hugging Face `datasets` directory or data files.", required=True,
        path="run"),
    Key("tokenizer", "str", "The target's tokenizer (relative to this file): a tokenizer.json, or a directory (with "
        "a tokenizer_config.json, read by transformers' AutoTokenizer with its chat template). Needed for text and "
        "chat data; for pre-tokenized data it supplies the padding id.", path="run"),
    Key("format", "str", "How to read the corpus: auto (from the path and the first record), text, chat "
        "(`messages`, rendered with the tokenizer's chat template; loss on assistant tokens only), tokens "
        "(`input_ids`, optional `loss_mask`), hf (a Hugging Face datasets directory or data files).",
        default="auto", choices=("auto", "text", "chat", "tokens", "hf")),
    Key("text_key", "str", "Field of each record that holds the text.", default="text"),
    Key("messages_key", "str", "Field of each chat record that holds the messages.", default="messages"),
    Key("chat_template", "str", "A Jinja chat template file (relative to this file) to use instead of the "
        "tokenizer's own (default: the tokenizer's, else a chat_template.jinja beside tokenizer.json). Needs "
        "`tokenizer`.", path="run"),
    Key("split", "str", "Split of a Hugging Face DatasetDict to read.", default="train"),
    Key("holdout", "int", "The last N documents of the corpus are the held-out split: never trained on, evaluated "
        "every train.eval_every steps.", default=0),
))

CAPTURE = Section("capture", "The hidden-state cache that `dflash-graph capture` writes and `run --hidden-states` "
                  "reads (docs/offline.md); `check --capture` prints its storage bill.", (
    Key("samples", "int", "Packed sequences of `seq` tokens the cache holds (the corpus, in samples). Absent: what "
        "`run` trains on, train.steps x train.grad_accum x the replicas of the target group.", low=1, high=10**12),
    Key("disk", "size", "Space the cache may take, e.g. \"40 TB\". Absent: the free space of the filesystem of "
        "`capture --out` (`check --capture DIR`), read with shutil.disk_usage.", default=None),
    Key("shard_samples", "int", "Samples per safetensors shard.", default=64, low=1, high=10**6),
    Key("storage", "str", "What is stored: `anchored` (what the checked graph's transfers carry; the anchors fixed "
        "at capture) or `all` (the transfers that do not depend on the anchors, and the inputs of the nodes that "
        "make the rest: the whole last hidden state, the loss mask; the anchors drawn again every epoch when read).",
        default="anchored", choices=("anchored", "all")),
    Key("dtype", "str", "How floating tensors are stored (with `storage = \"anchored\"`): `native` (as the transfers carry them) or `fp8` "
        "(float8_e4m3fn with one float32 scale per row, the last axis: amax / 448; dequantized when read).",
        default="native", choices=("native", "fp8")),
    Key("anchor_draws", "int", "Anchor draws stored per sample with the anchored storages (K): capture stores the "
        "transfers that depend on the anchors K times, draw e of sample i drawn with the generator of training "
        "sample e x samples + i (what the online run draws there); a run from the cache reads draw p mod K in its "
        "pass p over it, so passes K, K+1, ... repeat the draws. The transfers that do not depend on the anchors "
        "are stored once. Not with `storage = \"all\"`, which draws new anchors every pass.", default=1, low=1,
        high=1024),
))

TOP = Section("(top level)", "The sections of a graph file.", (
    Key("graph", "table", "See [graph]."),
    Key("dims", "table", "See [dims].", required=True),
    Key("devices", "table", "See [devices.<name>].", required=True),
    Key("groups", "table", "See [groups]."),
    Key("memory", "table", "See [memory]."),
    Key("launch", "table", "See [launch]."),
    Key("models", "table", "See [models.<name>]."),
    Key("nodes", "list", "See [[nodes]].", required=True),
    Key("train", "table", "See [train]."),
    Key("data", "table", "See [data]."),
    Key("capture", "table", "See [capture]."),
))

SECTIONS = (TOP, GRAPH, DIMS, DEVICE, GROUPS, MEMORY, LAUNCH, MODEL, NODE, TRAIN, DATA, CAPTURE)


# -- JSON Schema (for editors: taplo, Even Better TOML) ---------------------------------------------------------

# what units.parse_bytes accepts: a number and an optional unit (B, KB..TB, KiB..TiB, any case)
SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([bB]|[kKmMgGtT][iI]?[bB])?\s*$"

_KIND = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "size": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": SIZE_PATTERN}]},
    "dim": {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "minLength": 1}]},
    "list[str]": {"type": "array", "items": {"type": "string"}},
    "list[int]": {"type": "array", "items": {"type": "integer"}},
    "list[float]": {"type": "array", "items": {"type": "number"}},
    "table": {"type": "object"},
    "list": {"type": "array"},
    "any": {},
    "str|table": {"oneOf": [{"type": "string"}, {"type": "object"}]},
    "list|table": {"oneOf": [{"type": "array", "items": {"type": "string"}},
                             {"type": "object", "additionalProperties": {"type": "string"}}]},
}


def kind_schema(kind: str) -> dict:
    return dict(_KIND[kind])


def key_schema(k: Key) -> dict:
    out = kind_schema(k.kind)
    if k.choices:
        out = {"enum": list(k.choices)}
    out["description"] = k.doc
    if k.default is not None and k.default != {}:
        out["default"] = k.default
    return out


def section_schema(sec: Section) -> dict:
    out: dict = {"type": "object", "description": sec.doc,
                 "properties": {k.name: key_schema(k) for k in sec.keys}, "additionalProperties": False}
    req = [k.name for k in sec.keys if k.required]
    if req:
        out["required"] = req
    return out


def json_schema() -> dict:
    """The graph format as a JSON Schema (draft-07), from the sections above. The op and arch registries refine
    it (cli/reference.graph_json_schema: op names, each op's params, each arch's config keys)."""
    top = section_schema(TOP)
    props = top["properties"]
    props["graph"] = section_schema(GRAPH)
    props["dims"] = {"type": "object", "description": DIMS.doc,
                     "additionalProperties": {"oneOf": [{"type": "integer", "minimum": 1},
                                                        {"type": "string", "minLength": 1}]}}
    props["devices"] = {"type": "object", "description": DEVICE.doc, "minProperties": 1,
                        "additionalProperties": section_schema(DEVICE)}
    props["groups"] = {"type": "object", "description": GROUPS.doc,
                       "additionalProperties": {"type": "array", "items": {"type": "string"}, "minItems": 1}}
    props["memory"] = section_schema(MEMORY)
    props["launch"] = section_schema(LAUNCH)
    props["models"] = {"type": "object", "description": MODEL.doc, "additionalProperties": section_schema(MODEL)}
    props["nodes"] = {"type": "array", "description": NODE.doc, "minItems": 1, "items": section_schema(NODE)}
    props["train"] = section_schema(TRAIN)
    props["data"] = section_schema(DATA)
    props["capture"] = section_schema(CAPTURE)
    return {"$schema": "http://json-schema.org/draft-07/schema#",
            "$id": "https://github.com/dflash-graph/dflash-graph/docs/graph.schema.json",
            "title": "dflash-graph training graph",
            "description": "A DFlash drafter training graph (TOML). Generated from dflash_graph/spec/schema.py by "
                           "tools/gen_docs.py; see docs/editors.md.",
            **{k: v for k, v in top.items() if k != "description"}}


# -- walking a document by its sections ---------------------------------------------------------------------------

_BY_NAME = {s.name: s for s in SECTIONS}


def declared_tables(doc: dict):
    """(section, TOML path, table) for every table of a document that a declared section describes, in document
    order: [graph], each [devices.<name>], [models.<name>], [[nodes]], ... Free-form tables (dims, groups, a
    model's config) are not walked."""
    yield TOP, (), doc
    for key in TOP.keys:
        v = doc.get(key.name)
        sec = _BY_NAME.get(key.name)
        if isinstance(v, dict) and sec is not None and not sec.open:
            yield sec, (key.name,), v
        elif isinstance(v, dict) and f"{key.name}.<name>" in _BY_NAME:
            sec = _BY_NAME[f"{key.name}.<name>"]
            for name, t in v.items():
                if isinstance(t, dict):
                    yield sec, (key.name, name), t
        elif isinstance(v, list) and f"{key.name}[]" in _BY_NAME:
            for i, t in enumerate(v):
                if isinstance(t, dict):
                    yield _BY_NAME[f"{key.name}[]"], (key.name, i), t


def path_keys(doc: dict):
    """(TOML path, key, value) for every key declared as a path (`Key.path`) that the document sets."""
    for sec, where, table in declared_tables(doc):
        for k in sec.keys:
            if k.path and isinstance(table.get(k.name), str):
                yield (*where, k.name), k, table[k.name]
