"""Static and run-time contracts cannot disagree: --strict checks every node's tensors against the very types
`check` inferred (sizes, dtype, device) and the op's dim strings (jaxtyping, dims bound across all ports)."""

import pytest
import torch

from dflash_graph.exec.contracts import ContractViolation, check_node
from dflash_graph.ir.types import Dim, TensorType
from dflash_graph.ops import registry


def tt(*sizes, dtype="float32"):
    return TensorType(tuple(Dim(str(s), s) for s in sizes), dtype, "cpu")


def test_shape_that_static_inference_did_not_predict_is_caught():
    op = registry.get("lm_head")
    x, y = torch.zeros(4, 8), torch.zeros(4, 16)
    check_node(op, "head", {}, {"x": x, "logits": y}, {"x": tt(4, 8), "logits": tt(4, 16)}, "cpu", 1)
    with pytest.raises(ContractViolation, match="check inferred"):
        check_node(op, "head", {}, {"x": x, "logits": torch.zeros(4, 15)}, {"x": tt(4, 8), "logits": tt(4, 16)}, "cpu", 1)


def test_dtype_mismatch_is_caught():
    op = registry.get("norm")
    with pytest.raises(ContractViolation, match="dtype"):
        check_node(op, "n", {}, {"x": torch.zeros(4, 8, dtype=torch.float64)}, {"x": tt(4, 8)}, "cpu", 1)


def test_dims_bound_across_ports_by_jaxtyping():
    # without static types to compare with, the dim strings alone catch a batch mismatch between ports
    op = registry.get("lm_head")
    with pytest.raises(ContractViolation, match="parameter 'logits'.*batch=torch.Size"):
        check_node(op, "head", {}, {"x": torch.zeros(4, 8), "logits": torch.zeros(5, 16)}, {}, "cpu", 1)


def test_strict_run_catches_a_broken_implementation(in_repo, tmp_path, monkeypatch):
    from dflash_graph.cli.main import main
    from dflash_graph.ops import torch_impl

    real = torch_impl.norm
    monkeypatch.setattr(torch_impl, "norm", lambda c, x: {"out": real(c, x)["out"][..., :-1]})
    monkeypatch.setenv("DFLASH_GRAPH_DEBUG", "1")
    with pytest.raises(ContractViolation, match="norm"):
        main(["run", "graphs/tiny.toml", "--steps", "1", "--out", str(tmp_path), "--no-progress", "--strict"])
