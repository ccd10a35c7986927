"""Memory programs derived from transformers' own code (torch only; docs/memory-programs.md).

`record` runs a transformers causal LM once under FakeTensorMode with a dispatch-level recorder of storage
lifetimes; `archs` says how each supported arch is built from a few dims; `fit` matches the allocations of
traces at several sizes and fits each one's shape in the dims; `derive` writes the program as JSON under
`models/programs/`, which the pure-Python evaluator there reads.

This package imports torch and transformers. Neither `import dflash_graph` nor `check` imports it: `check`
reads the stored programs through `dflash_graph.models.programs`, which imports no torch.
"""
