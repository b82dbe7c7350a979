"""Every tile config of the autotuned Triton kernels on CUDA, one at a time, at one shape.

``make gpu-check`` runs the GPU tests with ``ATTN_EXT_TRITON_PIN=1``: one config per kernel and call
instead of an autotuning sweep per shape (``attn_ext.ops.utils.triton.pinning``), so the other GPU tests
run one config of each kernel, and a config that the autotuner may pick elsewhere but that computes a
wrong result would go unseen. Here each config runs alone (an autotuner over that config only):

- the attention forward and the backward's dK/dV and dQ kernels, shared by cross attention and
  ``scaled_dot_product_attention``, on each of their code paths: ``cross`` (cross attention with a key
  padding mask), ``causal`` (the causal rule, whose loop splits at the diagonal, with key padding and grouped
  key/value heads) and ``masked`` (a bool attention mask with key padding, dropout and grouped heads); fp16,
  D = Dv = 64, queries and keys above every tile (136 and 150, so the size buckets prune no config), against
  the fp64 ground truth with FlashAttention's accuracy rule. A config that the package's pruning drops on
  this card (its shared memory) is skipped, with that reason. Under compute-sanitizer
  (``ATTN_EXT_GPU_SANITIZE=1``) the ``cross`` path only;
- the tree forward: each config that its launcher builds for one small tree, against the C++ kernel;
- Intention's row products and dK/dV: each row tile (σIntention and the gradients too), against the C++ kernels.

Skipped, with the reason, without a CUDA device (``pytest -rs``).
"""
import pytest
import torch

import attn_ext as ae
from attn_ext.ops.utils import dispatch
from _gpu import cuda, grid, pytorch_grads_same_precision, pytorch_same_precision, unavailable
from _helpers import assert_within_flash_rule, backward_case, forward_case
from _sdpa_check import assert_sdpa_within_rule, sdpa_problem

triton = pytest.importorskip("triton")

from attn_ext.ops.attention import triton_bwd, triton_fwd, triton_tiles  # noqa: E402
from attn_ext.ops.attention.dropout import keep_mask  # noqa: E402
from attn_ext.ops.intention import triton_ridge  # noqa: E402
from attn_ext.ops.tree import triton_fwd as tree_fwd  # noqa: E402

SHAPE = (1, 2, 136, 136, 64, 64)  # cross attention: (B, H, M, N, D, Dv)
SDPA_SHAPE = (1, 4, 2, 136, 150, 64, 64)  # the op's paths: (B, Hq, Hkv, L, S, D, Dv)
CHUNK = 128  # the chunk hint caps BLOCK_N: 128 keeps every tile
DROPOUT_P = 0.2
CONFIGS = triton_tiles._gpu_configs()
#: The kernels' code paths (their per-pair constexprs), each run with every config.
PATHS = ("cross", "causal", "masked")


def _skip_reason(op: str):
    reason = unavailable("triton", op)
    return None if reason is None else f"triton backend not tested: {reason}"


def _only(config, kernel, key):
    """A factory like ``autotuned(kernel)``'s that launches ``kernel`` with ``config`` alone."""
    return lambda: triton.autotune(configs=[config], key=key)(kernel)


def _pruned_reason(config, q, m, n, path):
    """Why the package's pruning drops ``config`` for this path on this card, or None."""
    named = {"Q": q, "BLOCK_N_MAX": CHUNK, "M_BUCKET": triton_tiles._bucket(m), "N_BUCKET": triton_tiles._bucket(n)}
    flags = {"ATTN_MASK": 1, "HAS_DROPOUT": True} if path == "masked" else {}
    kept = triton_tiles._prune_configs(CONFIGS, named, BLOCK_D=triton_tiles.block_d(q.shape[3]),
                                       BLOCK_DV=triton_tiles.block_d(SHAPE[5]), **flags)
    if config in kept:
        return None
    return (f"{config} exceeds this card's shared memory at fp16 D = 64 on the {path} path "
            "(the autotuner never runs it here)")


def _config_id(index: int) -> str:
    return "M{}_N{}_w{}_s{}".format(*triton_tiles._GPU_TILES[index])


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=_config_id)
@pytest.mark.parametrize("path", grid(PATHS, ("cross",)))
def test_attention_config_forward_and_backward(path, index, monkeypatch):
    reason = _skip_reason("cross_attention" if path == "cross" else "scaled_dot_product_attention")
    if reason:
        pytest.skip(reason)
    config = CONFIGS[index]
    key = triton_tiles._TUNE_KEY
    monkeypatch.setattr(triton_fwd, "_fwd_kernel_tuned", _only(config, triton_fwd._fwd_kernel, key))
    monkeypatch.setattr(triton_bwd, "_bwd_dkdv_tuned", _only(config, triton_bwd._bwd_dkdv, key))
    monkeypatch.setattr(triton_bwd, "_bwd_dq_tuned", _only(config, triton_bwd._bwd_dq, key))
    if path == "cross":
        _cross_attention(config)
    else:
        _sdpa(config, path)


def _cross_attention(config):
    dtype = torch.float16
    q, k, v, mask, scale, refs = forward_case(*SHAPE, dtype, mask_kind="lengths")
    pruned = _pruned_reason(config, q.cuda(), SHAPE[2], SHAPE[3], "cross")
    if pruned:
        pytest.skip(pruned)
    (out64, lse64), cpu_pt = refs
    out_pt, lse_pt = pytorch_same_precision(q, k, v, mask, scale, cpu_pt, (out64, lse64))
    qc, kc, vc, mc = cuda(q, k, v, mask)
    out, lse = ae.cross_attention(qc, kc, vc, key_padding_mask=mc, scale=scale, chunk_size=CHUNK, return_lse=True,
                                  backend="triton")
    assert_within_flash_rule(out.cpu(), out64, out_pt, name=f"{config} out")
    assert_within_flash_rule(lse.cpu(), lse64, lse_pt, name=f"{config} lse")

    q, k, v, mask, scale, grad_out, grad_lse, ref, cpu_pt = backward_case(*SHAPE, dtype, mask_kind="lengths")
    pt = pytorch_grads_same_precision(q, k, v, mask, scale, grad_out, grad_lse, cpu_pt, ref)
    leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    out, lse = ae.cross_attention(*leaves, key_padding_mask=mask.cuda(), scale=scale, chunk_size=CHUNK,
                                  return_lse=True, backend="triton")
    grads = torch.autograd.grad((out, lse), leaves, cuda(grad_out, grad_lse))
    for label, g, g64, gpt in zip(("dq", "dk", "dv"), grads, ref, pt):
        assert_within_flash_rule(g.cpu(), g64, gpt, grad=True, name=f"{config} {label}")


def _sdpa(config, path):
    """Forward and backward of the op on the ``causal`` or ``masked`` path (bool mask, dropout) with ``config``."""
    B, Hq, Hkv, L, S, D, Dv = SDPA_SHAPE
    q, k, v, mask, padding = sdpa_problem(*SDPA_SHAPE, "causal" if path == "causal" else "bool", torch.float16)
    pruned = _pruned_reason(config, q.cuda(), L, S, path)
    if pruned:
        pytest.skip(pruned)
    p = DROPOUT_P if path == "masked" else 0.0
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(7)  # the op draws its dropout seed from the default CPU generator
    out, lse = ae.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.cuda(),
                                               dropout_p=p, is_causal=path == "causal", enable_gqa=True,
                                               key_padding_mask=padding.cuda(), chunk_size=CHUNK, return_lse=True,
                                               backend="triton")
    keep = None
    if p:
        torch.manual_seed(7)
        keep = keep_mask(int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)), p, (B, Hq, L, S))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    grads = torch.autograd.grad(out, leaves, grad_out.cuda())
    assert_sdpa_within_rule((out, lse, grads), (q, k, v), mask, padding, path == "causal", grad_out, keep=keep, p=p)


def _tree_problem(B=2, H=4, M=9, N=300, D=40, branching=2):
    g = torch.Generator().manual_seed(0)
    tree = ae.build_tree(torch.rand(B, N, 1, generator=g), branching=branching)
    tokens = torch.randn(B, N, H * 2 * D, generator=g)
    nodes = ae.tree_aggregate(tree, tokens).view(B, tree.num_nodes, H, 2 * D).permute(0, 2, 1, 3)
    q = torch.randn(B, H, M, D, generator=g)
    return tree, q, nodes[..., :D].contiguous(), nodes[..., D:].contiguous()


def _tree_configs():
    # The configs the launcher builds for _tree_problem(): block caps from M = 9, H = 4, D = Dv = 40.
    caps = tuple(tree_fwd._block_m_cap(9, 4, 64, w) for w in tree_fwd._WARPS)
    return tree_fwd.tree_configs(caps)


@pytest.mark.parametrize("index", range(len(_tree_configs())))
def test_tree_forward_config(index, monkeypatch):
    reason = _skip_reason("tree_cross_attention")
    if reason:
        pytest.skip(reason)
    config = _tree_configs()[index]
    monkeypatch.setattr(tree_fwd, "_tuned_kernel", lambda caps: triton.autotune(
        configs=[config], key=["H", "D", "DV", "height", "group_size"])(tree_fwd._tree_fwd_kernel))
    tree, q, node_k, node_v = _tree_problem()

    def args(device):
        t = tree.to(device)
        return (q.to(device), node_k.to(device), node_v.to(device), t.node_padding_mask, t.branching, t.height,
                t.group_size, 0.3, None)

    expected = dispatch.kernel("tree_cross_attention", "cpp")(*args("cpu"))
    got = dispatch.kernel("tree_cross_attention", "triton")(*args("cuda"))
    assert torch.equal(got[2].cpu(), expected[2]), f"{config}: other nodes selected than on the CPU"
    for name, ours, theirs in zip(("out", "lse", "selected", "log_prob", "entropy"), got, expected):
        if name != "selected":
            torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{config} {n}: {m}")


@pytest.mark.parametrize("index", range(len(triton_ridge._ROW_TILES)),
                         ids=lambda i: "M{}_w{}_s{}".format(*triton_ridge._ROW_TILES[i]))
def test_intention_config_forward_and_backward(index, monkeypatch):
    """Intention's row products and dK/dV kernels with one row tile each (pinned, the tests run the 64-row one)."""
    reason = _skip_reason("intention")
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(triton_ridge, "_tuned", lambda kernel, row_block, key: triton.autotune(
        configs=[triton_ridge.row_configs(row_block)[index]], key=list(key))(kernel))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, n, 40, generator=g) for n in (11, 130, 130))
    mask = torch.rand(2, 130, generator=g) < 0.3
    alpha = torch.tensor([0.5, 1.0, 2.0])
    grads = {}
    for name, device in (("cpp", "cpu"), ("triton", "cuda")):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (q, k, v, alpha)]
        m = mask.to(device)
        out = ae.intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=name)
        sig = ae.sigma_intention(*leaves[:3], alpha=leaves[3], key_padding_mask=m, backend=name)
        grads[device] = [out.detach().cpu(), sig.detach().cpu()] + [
            x.cpu() for x in torch.autograd.grad(out.sum() + sig.square().sum(), leaves)]
    for label, ours, theirs in zip(("out", "sigma", "dq", "dk", "dv", "dalpha"), grads["cuda"], grads["cpu"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-4,
                                   msg=lambda m, n=label: f"row tile {index} {n}: {m}")
