"""The one dispatch table: each op declares its backends, asks about its own kernels, and every
rejection carries a reason.

Runs on the CPU: the dispatch-table query of torch is monkeypatched, and a stand-in for a CUDA tensor
(only ``device``, ``dtype`` and ``shape`` are read by the checks) reaches the per-op test.
"""
from types import SimpleNamespace

import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch

FAKE_CUDA_Q = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float16, shape=(1, 2, 3, 8))


@pytest.fixture
def dispatch_table(monkeypatch):
    """CUDA kernels exist for the ops in the returned set only; every queried name is recorded."""
    present, asked = set(), []

    def has_kernel(op, key):
        asked.append((op, key))
        return op in present

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", has_kernel)
    return present, asked


def test_cuda_check_uses_the_kernel_of_the_op_called(dispatch_table):
    present, asked = dispatch_table
    present.add("attn_ext::tree_cross_attention_fwd")
    assert dispatch.rejection_reasons("tree_cross_attention", FAKE_CUDA_Q)["cuda"] is None
    reason = dispatch.rejection_reasons("cross_attention", FAKE_CUDA_Q)["cuda"]
    assert "no CUDA kernel for attn_ext::cross_attention_fwd" in reason
    assert asked == [("attn_ext::tree_cross_attention_fwd", "CUDA"), ("attn_ext::cross_attention_fwd", "CUDA")]


def test_every_public_op_is_declared_with_every_backend_reason():
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)  # float64: Triton refuses it even under the interpreter
    for op in ("cross_attention", "merge_states", "tree_cross_attention", "tree_aggregate", "intention",
               "sigma_intention", "batched_cholesky", "batched_cholesky_solve", "batched_spd_solve"):
        reasons = ae.available_backends(q, op)
        assert set(reasons) == set(ae.BACKENDS), op
        assert reasons["cpp"] is None, (op, reasons)
        assert all(isinstance(r, str) and r for name, r in reasons.items() if name in ("cuda", "triton")), (op, reasons)


def test_a_backend_an_op_lacks_says_so():
    reasons = ae.available_backends(torch.randn(2, 2), "batched_cholesky")
    assert reasons["reference"] == "attn_ext has no reference implementation of batched_cholesky"
    assert reasons["triton"] == "attn_ext has no triton implementation of batched_cholesky"


def test_old_schema_names_still_name_their_op():
    q = torch.randn(1, 2, 3, 8)
    assert ae.available_backends(q, "attn_ext::tree_cross_attention_fwd") == ae.available_backends(
        q, "tree_cross_attention")
    with pytest.raises(ValueError, match="unknown op 'attn_ext::no_such_op'"):
        ae.available_backends(q, "attn_ext::no_such_op")


def test_op_specific_requirements_rule_out_a_backend():
    tree = ae.build_tree(torch.rand(1, 10, 1), branching=2)
    values = torch.randn(1, 10, 4)
    with pytest.raises(RuntimeError, match=r"cpp: the compiled kernel runs reduce='mean' only, not a callable"):
        ae.tree_aggregate(tree, values, reduce=lambda children, pad: children.mean(-2), backend="cpp")
    ints = torch.arange(30).view(1, 10, 3)
    with pytest.raises(RuntimeError, match=r"cpp: the compiled kernel takes float16, bfloat16, float32 or float64"):
        ae.tree_aggregate(tree, ints, backend="cpp")


def test_environment_preference_is_ignored_by_ops_without_that_backend(monkeypatch, dispatch_table):
    present, _ = dispatch_table
    present.update({"attn_ext::tree_aggregate_fwd"})
    monkeypatch.setenv(dispatch.ENVIRONMENT_VARIABLE, "triton")
    assert dispatch.select_backend("tree_aggregate", None, torch.randn(2, 2)) == "cpp"
    with pytest.raises(RuntimeError, match="backend 'triton' cannot run"):
        dispatch.select_backend("cross_attention", None, torch.randn(2, 2, dtype=torch.float64))


def test_public_functions_ask_about_their_own_op(monkeypatch):
    seen = []
    real = dispatch._reason

    def recording(op, backend, x, context):
        seen.append(op)
        return real(op, backend, x, context)

    monkeypatch.setattr(dispatch, "_reason", recording)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 10, 10))

    def called(fn):
        seen.clear()
        fn()
        return set(seen)

    assert called(lambda: ae.cross_attention(q, k, v)) == {"cross_attention"}
    state = ae.attention_state(q, k, v)
    assert called(lambda: ae.merge_states(state, state)) == {"merge_states"}
    assert called(lambda: ae.intention(q, k, v)) == {"intention"}
    assert called(lambda: ae.sigma_intention(q, k, v)) == {"sigma_intention"}
    tree = ae.build_tree(torch.rand(1, 10, 1, generator=g), branching=2)
    assert called(lambda: ae.tree_aggregate(tree, torch.randn(1, 10, 8, generator=g))) == {"tree_aggregate"}
    node_k = ae.tree_aggregate(tree, k[:, 0])[:, None].expand(1, 2, -1, -1)
    assert called(lambda: ae.tree_cross_attention(q, node_k, node_k, tree)) == {"tree_cross_attention"}
    spd = torch.eye(3).expand(2, 3, 3)
    assert called(lambda: ae.batched_spd_solve(spd, torch.ones(2, 3, 1))) == {"batched_spd_solve"}


@pytest.fixture
def gpu_capability(monkeypatch):
    """Sets the compute capability that the fake CUDA device reports (the per-device cache is emptied)."""
    from attn_ext.ops.utils import cuda_capability

    def set_capability(major, minor):
        monkeypatch.setattr(cuda_capability, "_capabilities", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, minor))

    return set_capability


def test_bf16_is_refused_by_the_cuda_tensor_cores_below_ampere(dispatch_table, gpu_capability):
    present, _ = dispatch_table
    present.update({"attn_ext::cross_attention_fwd", "attn_ext::tree_cross_attention_fwd"})
    bf16 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, shape=(1, 2, 3, 8))
    gpu_capability(7, 5)  # T4
    reason = ae.available_backends(bf16)["cuda"]
    assert reason.startswith("bf16 needs compute capability 8.0; this device (cuda:0) is 7.5")
    assert ae.available_backends(FAKE_CUDA_Q)["cuda"] is None  # float16 runs on its tensor cores
    # Only the tensor-core kernels: the tree kernels convert bf16 to fp32 and run it anywhere.
    assert ae.available_backends(bf16, "tree_cross_attention")["cuda"] is None
    # Automatic dispatch goes elsewhere (here the reference: Triton has no GPU to run on); asking for
    # cuda raises with the reason.
    assert dispatch.select_backend("cross_attention", None, bf16) == "reference"
    with pytest.raises(RuntimeError, match=r"cuda: bf16 needs compute capability 8.0; this device \(cuda:0\) is 7.5"):
        dispatch.select_backend("cross_attention", "cuda", bf16)
    gpu_capability(8, 0)  # A100
    assert ae.available_backends(bf16)["cuda"] is None
