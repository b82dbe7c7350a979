"""Property tests (hypothesis) of the chunked attention state of docs/spec.md §1 on the cpp and reference
backends: chunking invariance, merge of states over key sets == attention over their union
("update then query == recompute"), merge algebra (associative, commutative, identity), and
invariance under permutation of the keys.

The merge is implemented here, in fp64, from the docs/spec.md §1 formula, independently of the library.
"""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn_ext as ae
from _helpers import require_backend

CPU_BACKENDS = ("cpp", "reference")
EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float64: torch.finfo(torch.float64).eps}


def merge(a, b):
    """docs/spec.md §1 merge of states (out, lse) over disjoint key sets, in fp64, guarding (-inf) - (-inf)."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    out_a, lse_a, out_b, lse_b = out_a.double(), lse_a.double(), out_b.double(), lse_b.double()
    lse = torch.logaddexp(lse_a, lse_b)
    empty = torch.isinf(lse)
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    w_a = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_a - safe))
    w_b = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_b - safe))
    return w_a[..., None] * out_a + w_b[..., None] * out_b, lse


def identity_state(out):
    return torch.zeros_like(out, dtype=torch.float64), torch.full(out.shape[:-1], -math.inf, dtype=torch.float64)


@st.composite
def problems(draw, max_n=40):
    """(q, k, v, mask, seed) with small random sizes; mask None or random (possibly fully padded rows)."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    M, N = draw(st.integers(1, 9)), draw(st.integers(1, max_n))
    D, Dv = draw(st.integers(1, 20)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([0.1, 1.0, 4.0]))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, M, D, generator=gen, dtype=torch.float64) * magnitude
    k = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, N, Dv, generator=gen, dtype=torch.float64)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(B, N, generator=gen) < draw(st.sampled_from([0.2, 0.6, 1.0]))
    return q, k, v, mask


def attend(backend, q, k, v, mask=None, chunk_size=None):
    return ae.cross_attention(q, k, v, key_padding_mask=mask, chunk_size=chunk_size, return_lse=True, backend=backend)


def assert_states_close(got, expected, dtype, n_terms, v, what):
    """Equal up to rounding of ``dtype``. The online softmax rounds once per chunk (or merge) and
    dot products over D may be blocked differently, so the bound is
    ``4 eps (n_terms + D + 4)`` relative to max(1, max|v|) for out and max(1, max|lse|) for lse."""
    (out, lse), (out_e, lse_e) = got, expected
    out, lse, out_e, lse_e = out.double(), lse.double(), out_e.double(), lse_e.double()
    assert not bool(torch.isnan(out).any() or torch.isnan(lse).any()), f"{what}: NaN"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_e)), f"{what}: -inf rows differ"
    tol = 4 * EPS[dtype] * (n_terms + v.shape[-1] + 4)
    finite = torch.isfinite(lse_e)
    if out.numel():
        out_err = float((out - out_e).abs().max())
        value_scale = max(1.0, float(v.abs().max())) if v.numel() else 1.0
        assert out_err <= tol * value_scale, f"{what}: out differs by {out_err:.3e} > {tol * value_scale:.3e}"
    if bool(finite.any()):
        lse_err = float((lse[finite] - lse_e[finite]).abs().max())
        lse_tol = tol * max(1.0, float(lse_e[finite].abs().max()))
        assert lse_err <= lse_tol, f"{what}: lse differs by {lse_err:.3e} > {lse_tol:.3e}"
    assert bool((out[~finite] == 0).all()), f"{what}: out of empty rows is not 0"


# ----------------------------------------------------------------------------------- (a) chunking


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(problem=problems(), chunk=st.integers(1, 45))
def test_chunking_invariance(backend, dtype, problem, chunk):
    q, k, v, mask = (t if t is None else t.to(dtype) if t.is_floating_point() else t for t in problem)
    require_backend(backend, q)
    N = k.shape[2]
    chunked = attend(backend, q, k, v, mask, chunk_size=chunk)
    whole = attend(backend, q, k, v, mask, chunk_size=N)
    assert_states_close(chunked, whole, dtype, n_terms=-(-N // chunk) + q.shape[-1], v=v, what=f"chunk={chunk} vs {N}")


# ----------------------------------------------------------------------------------- (b) merge == recompute


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(problem=problems(), data=st.data())
def test_merge_of_key_blocks_equals_recompute(backend, problem, data):
    """Attention over K1 ∪ K2 (contiguous blocks; K1 or K2 may be empty) == merge of the states."""
    q, k, v, mask = problem
    require_backend(backend, q)
    N = k.shape[2]
    n1 = data.draw(st.integers(0, N), label="n1")
    m1 = None if mask is None else mask[:, :n1]
    m2 = None if mask is None else mask[:, n1:]
    state1 = attend(backend, q, k[:, :, :n1], v[:, :, :n1], m1)
    state2 = attend(backend, q, k[:, :, n1:], v[:, :, n1:], m2)
    full = attend(backend, q, k, v, mask)
    assert_states_close(merge(state1, state2), full, torch.float64, n_terms=4 + q.shape[-1], v=v, what=f"split at {n1}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(problem=problems(), data=st.data())
def test_merge_of_masked_key_partition_equals_recompute(backend, dtype, problem, data):
    """Random disjoint key sets expressed as padding masks over the same keys (the update op's view)."""
    q, k, v, mask = (t if t is None else t.to(dtype) if t.is_floating_point() else t for t in problem)
    require_backend(backend, q)
    B, N = k.shape[0], k.shape[2]
    seed = data.draw(st.integers(0, 2**31 - 1), label="partition seed")
    in_first = torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) < 0.5
    padded = torch.zeros(B, N, dtype=torch.bool) if mask is None else mask
    state1 = attend(backend, q, k, v, padded | ~in_first)
    state2 = attend(backend, q, k, v, padded | in_first)
    full = attend(backend, q, k, v, mask)
    assert_states_close(merge(state1, state2), full, dtype, n_terms=8 + q.shape[-1], v=v, what="masked partition")


# ----------------------------------------------------------------------------------- (c) merge algebra


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(problem=problems(max_n=30), data=st.data())
def test_merge_is_associative_and_commutative_with_identity(backend, problem, data):
    q, k, v, mask = problem
    require_backend(backend, q)
    N = k.shape[2]
    cut1 = data.draw(st.integers(0, N), label="cut1")
    cut2 = data.draw(st.integers(cut1, N), label="cut2")

    def block(lo, hi):
        m = None if mask is None else mask[:, lo:hi]
        return attend(backend, q, k[:, :, lo:hi], v[:, :, lo:hi], m)

    a, b, c = block(0, cut1), block(cut1, cut2), block(cut2, N)
    full = attend(backend, q, k, v, mask)
    left, right = merge(merge(a, b), c), merge(a, merge(b, c))
    assert_states_close(left, right, torch.float64, n_terms=4 + q.shape[-1], v=v, what="associativity")
    assert_states_close(left, full, torch.float64, n_terms=6 + q.shape[-1], v=v, what="three blocks vs recompute")
    ab, ba = merge(a, b), merge(b, a)
    assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1]), "merge is not commutative"
    # Identity (0, -inf) is neutral on both sides, exactly.
    e = identity_state(a[0])
    for merged in (merge(a, e), merge(e, a)):
        assert torch.equal(merged[0], a[0].double()) and torch.equal(merged[1], a[1].double()), "identity"
    # The state of an empty or fully padded key set *is* the identity.
    empty_state = attend(backend, q, k[:, :, :0], v[:, :, :0])
    padded_state = attend(backend, q, k, v, torch.ones(k.shape[0], N, dtype=torch.bool))
    for s in (empty_state, padded_state):
        assert torch.equal(s[0].double(), e[0]) and torch.equal(s[1].double(), e[1]), "empty state is not (0, -inf)"


# ----------------------------------------------------------------------------------- (d) permutation


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("float32", "float64"))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@given(problem=problems(), perm_seed=st.integers(0, 2**31 - 1), chunk=st.integers(1, 45))
def test_key_permutation_invariance(backend, dtype, problem, perm_seed, chunk):
    q, k, v, mask = (t if t is None else t.to(dtype) if t.is_floating_point() else t for t in problem)
    require_backend(backend, q)
    N = k.shape[2]
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(perm_seed))
    permuted = attend(backend, q, k[:, :, perm], v[:, :, perm], None if mask is None else mask[:, perm], chunk)
    original = attend(backend, q, k, v, mask, chunk)
    assert_states_close(permuted, original, dtype, n_terms=-(-N // chunk) + q.shape[-1], v=v, what="permuted keys")
