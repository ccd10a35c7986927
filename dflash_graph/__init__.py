"""dflash-graph: a typed dataflow graph engine that checks, rewrites and runs DFlash drafter training.

Layers (imports point down this list only): spec -> ir -> ops/models -> analysis -> rewrite -> exec -> train -> cli.
`import dflash_graph` and `dflash-graph check` never import torch.
"""

__version__ = "0.1.0"
