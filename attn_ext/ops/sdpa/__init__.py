"""Masked scaled dot-product attention: ``torch.nn.functional.scaled_dot_product_attention``'s semantics
(attention masks, causal order, dropout, grouped key/value heads) on the chunked online-softmax kernels
of :mod:`attn_ext.ops.cross_attention` (docs/sdpa.md).

The public function is :mod:`.scaled_dot_product`; :mod:`.naive` is the readable reference, with the
pair rules of :mod:`.pairs` and the counter-based dropout of :mod:`.dropout`; :mod:`.registration`
binds every backend as a custom op.
"""
from attn_ext.ops.sdpa import registration  # noqa: F401  (custom ops, fakes, autograd, backends)
from attn_ext.ops.sdpa.scaled_dot_product import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention"]
