"""attn_ext.bench.allocator: inside heap_reuse a large freed tensor's pages are reused, outside they
are faulted in again (glibc serves blocks over 32 MB with fresh mmap'd pages)."""
import resource

import pytest
import torch

from attn_ext.bench.allocator import HEAP_REUSE_TEXT, _glibc, heap_reuse

NUMEL = 64 * 2**20 // 4  # 64 MB of fp32, above glibc's largest mmap threshold (32 MB)
PAGES = NUMEL * 4 // 4096


def _faults_of_second_fill() -> int:
    """Minor page faults of filling a fresh 64 MB tensor after an identical one was freed."""
    torch.empty(NUMEL).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(NUMEL).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(_glibc() is None, reason="heap_reuse needs glibc; elsewhere it yields None (tested below)")
def test_freed_pages_are_reused_inside_and_faulted_again_outside():
    assert _faults_of_second_fill() > PAGES // 2
    with heap_reuse() as text:
        assert text == HEAP_REUSE_TEXT
        assert _faults_of_second_fill() < PAGES // 10
    # glibc's own behaviour is back: the block is mmap'd afresh.
    assert _faults_of_second_fill() > PAGES // 2


def test_without_glibc_it_says_so(monkeypatch):
    import attn_ext.bench.allocator as allocator

    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    with heap_reuse() as text:
        assert text is None
