"""Device functions every Triton kernel of attn_ext shares (imports Triton: kernel modules only).

Padding keys are never loaded, not just masked after the load: whatever they hold (NaN, inf) must
not reach a result through 0·NaN, and a kernel must not read memory the caller marked unused.
"""
import triton
import triton.language as tl


@triton.jit
def valid_rows(MASK, mask_row, stride_n, offs, n, HAS_MASK: tl.constexpr):
    """Which of the rows ``offs`` exist (``< n``) and are not padding (``MASK[mask_row + offs·stride_n]``
    nonzero, a uint8 view of a bool padding mask; ``HAS_MASK`` False: no mask, never read)."""
    ok = offs < n
    if HAS_MASK:
        pad = tl.load(MASK + mask_row + offs * stride_n, mask=ok, other=1)
        ok = ok & (pad == 0)
    return ok


@triton.jit
def load_tile(base, rows, cols, stride_r, stride_c, rows_ok, cols_ok, UPCAST: tl.constexpr):
    """The ``[rows, cols]`` tile at ``base``, 0 (and not loaded) outside ``rows_ok`` × ``cols_ok``;
    fp32 when ``UPCAST`` (fp32 arithmetic on half inputs; the interpreter's bf16 ``tl.dot`` needs it too)."""
    x = tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c,
                mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def attention_rows(acc, l_i, m_i):
    """``(out, lse)`` of the rows of an online softmax: the weighted sums ``acc`` ``[rows, cols]``, the sums of
    weights ``l_i`` and the running maxima ``m_i`` of the scores (natural units), in float32.

    ``l_i = 0``: no key carries weight (all padded, or every score -inf): the empty row (0, -inf). A NaN score
    (or +inf - +inf) leaves ``l_i`` and ``acc`` NaN whatever the maxima did with it (a GPU max may drop NaN):
    NaN, never empty. ``lse = m_i + log(l)``, the cpp kernel's formula: for a dominant huge score it rounds to
    that very score, so the backward's ``s - lse`` is exactly 0 there."""
    positive = l_i > 0.0
    l_safe = tl.where(positive, l_i, 1.0)
    out = tl.where(positive[:, None], acc / l_safe[:, None], float("nan"))
    lse = tl.where(positive, m_i + tl.log(l_safe), float("nan"))
    out = tl.where((l_i == 0.0)[:, None], 0.0, out)
    lse = tl.where(l_i == 0.0, float("-inf"), lse)
    return out, lse


@triton.jit
def rows_descriptor(base, rows, cols, row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A TMA tensor descriptor over the ``[rows, cols]`` matrix at ``base`` (unit column stride) in boxes of
    ``[BLOCK_R, BLOCK_C]``: a box past ``rows`` or ``cols`` loads zeros there and stores nothing there."""
    return tl.make_tensor_descriptor(base, shape=[rows, cols], strides=[row_stride, 1], block_shape=[BLOCK_R, BLOCK_C])


@triton.jit
def load_box(desc, row, UPCAST: tl.constexpr):
    """The box of ``desc`` starting at ``row`` (column 0); fp32 when ``UPCAST``, as :func:`load_tile`."""
    x = desc.load([row, 0])
    if UPCAST:
        x = x.to(tl.float32)
    return x
