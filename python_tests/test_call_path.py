"""The public functions' fast way into the ops (``attn_ext.ops.utils.autograd.fast_entry`` and the
extension's ``call_op``) must behave exactly as calling ``torch.ops.attn_ext`` would: same results, same
errors, every dispatch key still honoured (modes, subclasses, fake tensors, the profiler), and the
ordinary path taken for whatever the fast one does not convert."""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import attn_ext as ae
from attn_ext.ops.utils import extension

pytestmark = pytest.mark.skipif(extension.extension_error() is not None, reason=str(extension.extension_error()))


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, m, 8, generator=g) for m in (4, 7, 7))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _index(name):
    from attn_ext import _C

    return _C, _C.op_index(f"attn_ext::{name}")


def test_call_op_matches_torch_ops():
    _C, index = _index("cross_attention_fwd")
    q, k, v = _qkv()
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 3:] = True
    for key_padding_mask in (None, mask):
        got = _C.call_op(index, True, q, k, v, key_padding_mask, 0.3, 4)
        expected = torch.ops.attn_ext.cross_attention_fwd(q, k, v, key_padding_mask, 0.3, 4)
        assert isinstance(got, tuple) and len(got) == 2
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["subclass", "numpy_scalar", "bool_for_int", "int_for_float", "too_few", "list"])
def test_call_op_declines_what_it_does_not_convert(bad):
    _C, index = _index("cross_attention_fwd")
    q, k, v = _qkv()
    args = [q, k, v, None, 0.3, 4]
    if bad == "subclass":
        args[0] = q.as_subclass(_Logged)
    elif bad == "numpy_scalar":
        args[5] = np.int64(4)
    elif bad == "bool_for_int":
        args[5] = True
    elif bad == "int_for_float":
        args[4] = 1
    elif bad == "too_few":
        args = args[:5]
    elif bad == "list":
        args[1] = k.tolist()
    assert _C.call_op(index, True, *args) is NotImplemented


def test_call_op_raises_the_kernels_errors_with_their_python_types():
    _C, index = _index("cross_attention_fwd")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^attn_ext: q .* and k .* must have the same head dim D"):
        _C.call_op(index, True, q, k[..., :5], v, None, 0.3, 4)
    with pytest.raises(RuntimeError, match="no op"):
        _C.call_op(10**6, True, q, k, v, None, 0.3, 4)


class _Logged(torch.Tensor):
    """A tensor subclass whose __torch_function__ records what reached it."""

    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclasses_and_modes_still_see_the_op():
    q, k, v = _qkv()
    _Logged.seen.clear()
    out = ae.cross_attention(q.as_subclass(_Logged), k, v)
    assert any("cross_attention_fwd" in name for name in _Logged.seen)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ae.cross_attention(q, k, v))

    for mode_class in (TorchFunctionMode, TorchDispatchMode):  # above and below the Python arguments
        with _recording(mode_class) as recorder:
            ae.cross_attention(q, k, v)
        assert any("cross_attention_fwd" in name for name in recorder.seen), mode_class


def _recording(mode_class):
    """A mode of ``mode_class`` that records the name of every call it sees."""
    hook = "__torch_function__" if mode_class is TorchFunctionMode else "__torch_dispatch__"

    def record(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))

    mode = type("Recorder", (mode_class,), {hook: record})()
    mode.seen = []
    return mode


def test_fake_tensors_and_the_profiler():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in _qkv())
        out, lse = ae.cross_attention(q, k, v, return_lse=True)
        assert out.shape == (2, 3, 4, 8) and lse.shape == (2, 3, 4)
    q, k, v = _qkv()
    with torch.profiler.profile() as prof:
        with torch.no_grad():
            ae.cross_attention(q, k, v)
    assert any(e.name == "attn_ext::cross_attention_fwd" for e in prof.events())


def test_every_path_gives_the_same_values_and_gradients():
    q, k, v = _qkv()
    with torch.no_grad():
        no_grad = ae.cross_attention(q, k, v)
    qg, kg, vg = _qkv(requires_grad=True)
    out = ae.cross_attention(qg, kg, vg)
    torch.testing.assert_close(out.detach(), no_grad, rtol=0, atol=0)
    out.square().sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (qg, kg, vg))
    torch.nn.functional.scaled_dot_product_attention(q64, k64, v64).square().sum().backward()
    for ours, ref in ((qg, q64), (kg, k64), (vg, v64)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)
    # A graph of the backward (create_graph) still goes through the composite: second derivatives exist.
    qg.grad = None
    (grad_q,) = torch.autograd.grad(ae.cross_attention(qg, kg, vg).square().sum(), qg, create_graph=True)
    assert grad_q.requires_grad


# ------------------------------------------------------------------ the C++ autograd node of plain calls


def test_plain_reverse_mode_calls_get_the_cpp_node_and_every_order_stays_exact():
    q, k, v = (t.double().detach().requires_grad_() for t in _qkv())
    out = ae.cross_attention(q, k, v)
    assert "FusedOp" in out.grad_fn.name()  # the C++ node, not the Python Function
    for fn in (lambda q, k, v: ae.cross_attention(q, k, v, return_lse=True),
               lambda q, k, v: ae.scaled_dot_product_attention(q, k, v, is_causal=True)):
        assert torch.autograd.gradcheck(fn, (q, k, v))
        assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_cpp_node_keeps_autograd_rules():
    q, k, v = _qkv(requires_grad=True)
    out = ae.cross_attention(q, k, v)
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    out.sum().backward()  # retained: a second backward gives the same gradient again
    torch.testing.assert_close(q.grad, 2 * first)
    out = ae.cross_attention(q, k, v)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        out.sum().backward()
    out = ae.cross_attention(q, k, v)
    with torch.no_grad():
        k.add_(1.0)  # a saved input changed in place: autograd's version check must catch it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_only_the_gradients_the_rule_gives_take_the_cpp_node():
    q, k, v = _qkv(requires_grad=True)
    mask = torch.zeros(2, 3, 4, 7, requires_grad=True)  # a gradient the fused rule does not give: not its node
    out = ae.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert "FusedOp" not in out.grad_fn.name()
    out.pow(2).sum().backward()
    assert mask.grad is not None and mask.grad.abs().max() > 0
    tree = ae.build_tree(torch.rand(2, 7, 1, generator=torch.Generator().manual_seed(1)), branching=2)
    node_k = ae.tree_aggregate(tree, k.detach()[:, 0])[:, None].expand(2, 3, -1, -1).contiguous().requires_grad_()
    result = ae.tree_cross_attention(q, node_k, node_k, tree)
    assert "FusedOp" in result.out.grad_fn.name() and not result.selected.requires_grad
    (result.out.sum() + result.log_prob.sum()).backward()
    assert node_k.grad is not None and torch.isfinite(node_k.grad).all()
    state_a, state_b = ae.attention_state(q, k, v), ae.attention_state(q, k[:, :, :3], v[:, :, :3])
    merged = ae.merge_states(state_a, state_b)
    assert "FusedOp" in merged.out.grad_fn.name()
    merged.out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cpp_node_with_one_tensor_as_q_k_v_checkpointing_and_threads():
    import threading

    from torch.utils.checkpoint import checkpoint

    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: ae.cross_attention(x, x, x), (x,))  # one edge taken three times
    checkpoint(lambda x: ae.cross_attention(x, x, x).sin(), x, use_reentrant=False).sum().backward()
    recomputed, x.grad = x.grad, None
    ae.cross_attention(x, x, x).sin().sum().backward()
    torch.testing.assert_close(recomputed, x.grad, rtol=0, atol=0)

    def train(results, seed):
        a = torch.randn(4, 2, 16, 8, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        for _ in range(20):
            ae.cross_attention(a, a, a).square().sum().backward()
        expected = a.detach().clone().requires_grad_()
        torch.nn.functional.scaled_dot_product_attention(expected, expected, expected).square().sum().backward()
        results.append(torch.allclose(a.grad, 20 * expected.grad, rtol=1e-4, atol=1e-5))

    results = []
    threads = [threading.Thread(target=train, args=(results, seed)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4


def test_cpp_node_under_batched_gradients():
    # torch.autograd.grad(is_grads_batched=True) runs the node's backward under vmap.
    q, k, v = (t.double().detach().requires_grad_() for t in _qkv())
    out = ae.cross_attention(q, k, v)
    assert "FusedOp" in out.grad_fn.name()
    grads = torch.randn(3, *out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (batched,) = torch.autograd.grad(out, q, grads, is_grads_batched=True, retain_graph=True)
    one_by_one = torch.stack([torch.autograd.grad(out, q, g, retain_graph=True)[0] for g in grads])
    torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=1e-12)
