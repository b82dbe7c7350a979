"""Device functions of the per-pair masks of the attention Triton kernels: the attention mask and causal
rule, dropout's keep mask, and the exact product used where a GEMM would read a masked pair.

Every function takes its query and key indices as broadcastable 2-D tensors (``m2``: ``[R, 1]`` or
``[1, R]``, ``n2`` the other way), so the forward and dQ kernels (``[queries, keys]`` tiles) and the
dK/dV kernel (``[keys, queries]`` tiles) share them.

The key padding mask is not here: it is per key, so padded keys are never loaded at all
(:func:`attn_ext.ops.utils.triton_jit.valid_rows`). A per-pair mask cannot skip loads, and a
GEMM over a tile multiplies every weight by every row: a zero weight of a masked pair times a
NaN or inf row gives NaN. :func:`pair_dot_into` therefore switches a tile to an exact sum over the
allowed pairs when, and only when, the tile has a masked pair and a non-finite operand row.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def masked_scores(s, ATTN, sam, san, m2, n2, ok, ATTN_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(scores, allowed)`` of the pairs (``m2``, ``n2``) among ``ok``: the causal rule (key ``n`` only
    for queries ``m >= n``) and the attention mask at ``ATTN`` (the batch and head's ``[L, S]`` view
    with strides ``sam``, ``san``; ``ATTN_MASK`` 0: none, 1: bool as uint8, 1 = take part,
    2: additive float, ``-inf`` = masked). Masked scores are ``-inf``; the mask is read only
    where ``ok`` and the causal rule allow."""
    allowed = ok
    if IS_CAUSAL:
        allowed = allowed & (n2 <= m2)
    # int64: a dense [L, S] mask may have more than 2**31 elements.
    ptrs = ATTN + m2.to(tl.int64) * sam + n2.to(tl.int64) * san
    if ATTN_MASK == 1:
        allowed = allowed & (tl.load(ptrs, mask=allowed, other=0) != 0)
    if ATTN_MASK == 2:
        bias = tl.load(ptrs, mask=allowed, other=float("-inf")).to(tl.float32)
        allowed = allowed & (bias != float("-inf"))
        s = s + bias
    return tl.where(allowed, s, float("-inf")), allowed


@triton.jit
def dropout_keep(SEED, rows2, n2, N, threshold):
    """Which pairs dropout keeps: Philox4x32-10 keyed by the int64 seed at ``SEED`` of the counter
    ``row·N + n`` (``rows2``: the global query row ``(b·Hq + h)·L + m``, int64), kept iff the word
    is ``>= threshold`` (``floor(p·2^32)``). ``tl.randint`` with an int64 offset is exactly that
    generator (the offset's low and high words are the first two counter words)."""
    seed = tl.load(SEED)
    word = tl.randint(seed, rows2.to(tl.int64) * N + n2)
    # uint32 -> int64 zero-extends, and the threshold (up to 2**32 - 1) is an int32 or int64 argument.
    return word.to(tl.int64) >= threshold


@triton.jit
def _any_nonfinite(x):
    return tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)) > 0


@triton.jit
def _exact_dot_into(acc, a, b, allowed, BLOCK_K: tl.constexpr):
    # acc + sum_j where(allowed[:, j], a[:, j] * b[j, :], 0), one column of a and row of b at a time, added
    # in place; the selections are `where`s, so the other rows' NaNs never enter a sum.
    ks = tl.arange(0, BLOCK_K)
    for j in range(0, BLOCK_K):
        col = (ks == j)[None, :]
        a_j = tl.sum(tl.where(col, a, 0.0), 1)
        ok_j = tl.sum(tl.where(col & allowed, 1, 0), 1) > 0
        b_j = tl.sum(tl.where((ks == j)[:, None], b.to(tl.float32), 0.0), 0)
        acc += tl.where(ok_j[:, None], a_j[:, None] * b_j[None, :], 0.0)
    return acc


@triton.jit
def pair_dot_into(acc, a, b, allowed, rows_ok, cols_ok, PAIR_MASKS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` in float32 for pair weights ``a`` ``[R, K]`` (zero outside ``allowed``) and operand
    rows ``b`` ``[K, C]`` (loaded where ``cols_ok``), reading no row of ``b`` through a masked pair.

    Without per-pair masks (``PAIR_MASKS`` False) every unloaded pair's row is 0 and this is the
    GEMM. With them, a tile whose loaded pairs are all allowed, or whose ``b`` is finite, still
    takes the GEMM; otherwise the exact sum over the allowed pairs (slow, and only there).
    Both add into ``acc`` (the MMA's accumulator operand; the exact sum in place): a separate
    ``[R, C]`` result tile beside the accumulator was what made the causal backward spill
    (dK/dV at D = 128 on sm_90: 300-3500 bytes in every tile but 16 x 16, Triton 3.9)."""
    if PAIR_MASKS:
        masked = tl.sum((rows_ok[:, None] & cols_ok[None, :] & (allowed == 0)).to(tl.int32)) > 0
        if masked & _any_nonfinite(b):
            acc = _exact_dot_into(acc, a, b, allowed, BLOCK_K)
        else:
            acc = tl.dot(a.to(b.dtype), b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision="ieee")
    return acc


@triton.jit
def _exact_causal_dot_into(acc, a, b, offs_r, start_k, K, ROWS_ARE_KEYS: tl.constexpr, BLOCK_K: tl.constexpr):
    # acc + sum_j a[:, j] * b[j, :] over the pairs the causal rule allows between row offs_r and inner index
    # start_k + j (rows are keys: key <= query; rows are queries: key <= query and key < K), one j at a time.
    ks = tl.arange(0, BLOCK_K)
    for j in range(0, BLOCK_K):
        a_j = tl.sum(tl.where((ks == j)[None, :], a, 0.0), 1)
        b_j = tl.sum(tl.where((ks == j)[:, None], b.to(tl.float32), 0.0), 0)
        if ROWS_ARE_KEYS:
            ok_j = offs_r <= start_k + j
        else:
            ok_j = (start_k + j <= offs_r) & (start_k + j < K)
        acc += tl.where(ok_j[:, None], a_j[:, None] * b_j[None, :], 0.0)
    return acc


@triton.jit
def causal_dot_into(acc, a, b, offs_r, start_k, K, ROWS_ARE_KEYS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` for a block the causal diagonal crosses, reading no row of ``b`` through a pair above it:
    :func:`pair_dot_into` with the rule computed from the indices (rows ``offs_r``, inner indices ``start_k +
    j``; ``ROWS_ARE_KEYS``: dK's ``dSᵀ Q``, else dQ's ``dS K`` and the forward's ``P V``, whose keys also stop
    at ``K``) instead of reduced from a pair-mask tile, which kept the TMA backward's registers over the
    limit. The GEMM unless a pair above the diagonal meets a non-finite row of ``b``."""
    if ROWS_ARE_KEYS:
        above = tl.max(offs_r) > start_k
    else:
        above = start_k + BLOCK_K - 1 > tl.min(offs_r)
    if above & _any_nonfinite(b):
        acc = _exact_causal_dot_into(acc, a, b, offs_r, start_k, K, ROWS_ARE_KEYS, BLOCK_K)
    else:
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision="ieee")
    return acc


# --------------------------------------------------------------------------- host side

def attn_mask_arg(attn_mask, fallback):
    """``(pointer tensor, (stride_b, stride_h, stride_m, stride_n), ATTN_MASK)`` of a 4-D attention
    mask view, never copied (broadcast dims keep their stride 0); bool loads through a free uint8 view.
    Without a mask ``fallback`` is passed, never read (``ATTN_MASK`` 0)."""
    if attn_mask is None:
        return fallback, (0, 0, 0, 0), 0
    if attn_mask.dtype == torch.bool:
        return attn_mask.view(torch.uint8), attn_mask.stride(), 1
    return attn_mask, attn_mask.stride(), 2


def all_finite(*tensors) -> torch.Tensor:
    """A bool scalar tensor (no host sync): whether every element of ``tensors`` is finite, read from float32 sums.
    Sound for the guard it decides: a NaN or inf element makes its sum NaN or inf, and a sum that overflows from
    finite values only sends a call down the guarded path, which is exact too."""
    return torch.stack([torch.isfinite(torch.sum(t, dtype=torch.float32)) for t in tensors]).all()


def dropout_arg(dropout_p: float, dropout_seed, fallback):
    """``(seed tensor on fallback's device, threshold, 1 / (1 - p), HAS_DROPOUT)``. The seed stays a
    tensor read inside the kernel, so that a compiled or captured graph does not bake in its value;
    the threshold is ``floor(p·2^32)`` computed in double precision."""
    if dropout_p == 0.0:
        return fallback, 0, 1.0, False
    seed = dropout_seed.reshape(1).to(device=fallback.device, non_blocking=True)
    return seed, int(float(dropout_p) * 4294967296.0), 1.0 / (1.0 - float(dropout_p)), True
