"""Device functions of the Triton TE-attention kernels (imports Triton: kernel modules only): the MLP ρ over a tile
of (query, key) pairs, one chunk of hidden units at a time.

A tile is ``[BLOCK_M, BLOCK_N]`` pairs. Its features ``[BLOCK_M, BLOCK_N, BLOCK_F]`` are every head's scaled dot
product ``s_h = scale·q_h·k_hᵀ`` (a ``tl.dot`` per head) and the input differences ``xq_d − xk_d``, formed once per
tile; ρ's first layer is linear in them, so a chunk of ``HIDDEN_CHUNK`` hidden units' pre-activations
``[BLOCK_M, BLOCK_N, HIDDEN_CHUNK]`` is a sum of each feature times that chunk's column of ``w1``. Holding one chunk
rather than all ``hidden`` units keeps the 3-D tiles small (a feature dimension of a few lanes lives in one thread:
its slices are register selects).
"""
import triton
import triton.language as tl

# The activation codes of csrc/include/attn_ext/te_activation.h.
RELU: tl.constexpr = 0
GELU: tl.constexpr = 1
SILU: tl.constexpr = 2


@triton.jit
def activate(x, ACT: tl.constexpr):
    """ρ's activation, as torch computes it (relu keeps NaN; gelu is the erf form; tanh from one exp)."""
    if ACT == 0:
        y = tl.where(x < 0.0, 0.0, x)
    elif ACT == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        y = x / (1.0 + tl.exp(-x))
    else:
        y = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return y


@triton.jit
def activation_derivative(x, ACT: tl.constexpr):
    """``act'(x)`` (relu: 1 above 0, else 0, as torch's relu backward)."""
    if ACT == 0:
        y = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 1:
        y = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == 2:
        s = 1.0 / (1.0 + tl.exp(-x))
        y = s * (1.0 + x * (1.0 - s))
    else:
        t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        y = 1.0 - t * t
    return y


@triton.jit
def head_scores(Q, K, q_row, k_row, sqh, sqm, sqd, skh, skn, skd, h, offs_m, offs_n, offs_d, m_ok, n_ok, d_ok, scale):
    """``scale · q_h · k_hᵀ`` ``[BLOCK_M, BLOCK_N]`` of head ``h`` (fp32, IEEE products: the logits' MLP is not
    trained for TF32's rounding), unpadded keys only read."""
    q = tl.load(Q + q_row + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    k = tl.load(K + k_row + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    return tl.dot(q, tl.trans(k), input_precision="ieee") * scale


@triton.jit
def input_difference(XQ, XK, xq_row, xk_row, sxqm, sxqd, sxkn, sxkd, d, offs_m, offs_n, m_ok, n_ok):
    """``xq_d − xk_d`` ``[BLOCK_M, BLOCK_N]`` of input dimension ``d``, formed before any product."""
    xq = tl.load(XQ + xq_row + offs_m * sxqm + d * sxqd, mask=m_ok, other=0.0).to(tl.float32)
    xk = tl.load(XK + xk_row + offs_n * sxkn + d * sxkd, mask=n_ok, other=0.0).to(tl.float32)
    return xq[:, None] - xk[None, :]


@triton.jit
def tile_features(Q, K, XQ, XK, q_row, k_row, xq_row, xk_row, sqh, sqm, sqd, skh, skn, skd, sxqm, sxqd, sxkn, sxkd,
                  offs_m, offs_n, offs_d, offs_f, m_ok, n_ok, d_ok, scale, H: tl.constexpr, DX: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """ρ's inputs ``[BLOCK_M, BLOCK_N, BLOCK_F]`` of the tile: features ``0..H-1`` every head's scaled dot product,
    ``H..H+DX-1`` the input differences, the rest 0. Formed once per tile; the hidden chunks read slices of it."""
    features = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_F], tl.float32)
    for h in tl.static_range(H):
        s = head_scores(Q, K, q_row, k_row, sqh, sqm, sqd, skh, skn, skd, h, offs_m, offs_n, offs_d, m_ok, n_ok, d_ok,
                        scale)
        features += tl.where(offs_f[None, None, :] == h, s[:, :, None], 0.0)
    for d in tl.static_range(DX):
        diff = input_difference(XQ, XK, xq_row, xk_row, sxqm, sxqd, sxkn, sxkd, d, offs_m, offs_n, m_ok, n_ok)
        features += tl.where(offs_f[None, None, :] == H + d, diff[:, :, None], 0.0)
    return features


@triton.jit
def chunk_preactivations(features, W1, B1, offs_f, c0, HIDDEN, F: tl.constexpr, HIDDEN_CHUNK: tl.constexpr):
    """Pre-activations ``[BLOCK_M, BLOCK_N, HIDDEN_CHUNK]`` of hidden units ``c0 .. c0 + HIDDEN_CHUNK`` from the
    tile's features (units past ``HIDDEN`` have zero weights: 0, and act(0) = 0)."""
    offs_c = c0 + tl.arange(0, HIDDEN_CHUNK)
    c_ok = offs_c < HIDDEN
    pre = tl.load(B1 + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, None, :]
    for f in tl.static_range(F):
        w = tl.load(W1 + offs_c * F + f, mask=c_ok, other=0.0).to(tl.float32)
        pre += head_slice(features, offs_f, f)[:, :, None] * w[None, None, :]
    return pre


@triton.jit
def tile_logits(features, W1, B1, W2, B2, offs_f, offs_h, HIDDEN, H: tl.constexpr, F: tl.constexpr, ACT: tl.constexpr,
                HIDDEN_CHUNK: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_H: tl.constexpr):
    """Every head's logits ``[BLOCK_M, BLOCK_N, BLOCK_H]`` of the tile (heads past H: 0), ρ run chunk by chunk."""
    logits = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_H], tl.float32)
    for h in tl.static_range(H):
        logits += tl.where(offs_h[None, None, :] == h, tl.load(B2 + h).to(tl.float32), 0.0)
    # A loop, not unrolled: unrolled, the chunks' independent tiles were all live at once (255 registers and
    # spills on sm_90).
    for c0 in range(0, BLOCK_HIDDEN, HIDDEN_CHUNK):
        hid = activate(chunk_preactivations(features, W1, B1, offs_f, c0, HIDDEN, F, HIDDEN_CHUNK), ACT)
        offs_c = c0 + tl.arange(0, HIDDEN_CHUNK)
        for h in tl.static_range(H):
            w = tl.load(W2 + h * HIDDEN + offs_c, mask=offs_c < HIDDEN, other=0.0).to(tl.float32)
            logits += tl.where(offs_h[None, None, :] == h, tl.sum(hid * w[None, None, :], 2)[:, :, None], 0.0)
    return logits


@triton.jit
def head_slice(x, offs_h, h):
    """``x[:, :, h]`` of a ``[rows, cols, BLOCK]`` tile."""
    return tl.sum(tl.where(offs_h[None, None, :] == h, x, 0.0), 2)
