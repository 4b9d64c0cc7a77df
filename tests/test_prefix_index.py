"""The prefix index and the reference-counted page allocator on their own (no model)."""

from __future__ import annotations

import pytest

from coordinator.model.kv_cache import OutOfPages, PageAllocator
from coordinator.model.prefix_cache import PrefixIndex

P = 2  # page size


def chain(index: PrefixIndex, tokens: list[int], salt=None) -> list[int]:
    """Allocates and indexes the full pages of ``tokens`` as one sequence would; returns them held."""
    pages = index.pages.alloc(len(tokens) // P)
    parent = None
    for i, page in enumerate(pages):
        parent = index.add(parent, salt, tokens[i * P : (i + 1) * P], page)
        assert parent is not None
    return pages


def test_released_pages_are_kept_counted_free_and_evicted_last_page_first():
    alloc = PageAllocator(4)
    index = PrefixIndex(P, alloc)
    held = chain(index, [1, 2, 3, 4, 5, 6])
    assert alloc.num_free == 1 and index.num_pages == 3
    alloc.free(held)
    assert alloc.num_free == 4 and alloc.num_kept == 3
    assert [b.page for b in index.match([1, 2, 3, 4, 5, 6, 7], None, 9)] == held
    # the free page goes first, then the chain from its end: what is left is still a prefix
    assert alloc.alloc(1) not in held
    assert alloc.alloc(1) == [held[2]]
    assert [b.page for b in index.match([1, 2, 3, 4, 5, 6], None, 9)] == held[:2]
    assert alloc.alloc(2) == [held[1], held[0]]
    assert index.match([1, 2, 3, 4], None, 9) == [] and index.num_pages == 0


def test_shared_pages_are_never_evicted():
    alloc = PageAllocator(3)
    index = PrefixIndex(P, alloc)
    held = chain(index, [1, 2, 3, 4])
    alloc.free(held)
    blocks = index.match([1, 2, 3, 4], None, 2)
    alloc.share([b.page for b in blocks])  # a new sequence takes the cached prefix
    assert alloc.num_free == 1 and alloc.num_kept == 0
    with pytest.raises(OutOfPages):
        alloc.alloc(2)
    alloc.alloc(1)
    assert index.num_pages == 2
    alloc.free([b.page for b in blocks])
    assert alloc.num_free == 2 and alloc.num_kept == 2


def test_a_page_held_twice_is_released_by_its_last_holder():
    alloc = PageAllocator(2)
    index = PrefixIndex(P, alloc)
    held = chain(index, [7, 7])
    alloc.share(held)
    alloc.free(held)
    assert alloc.num_free == 1 and alloc.refs(held[0]) == 1
    alloc.free(held)
    assert alloc.num_free == 2 and alloc.num_kept == 1
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(alloc.alloc(1) * 2)


def test_unindexed_pages_go_straight_back_to_the_free_list():
    alloc = PageAllocator(2)
    PrefixIndex(P, alloc)
    alloc.free(alloc.alloc(2))
    assert alloc.num_free == 2 and alloc.num_kept == 0


def test_keys_hold_the_salt_the_parent_and_every_token():
    alloc = PageAllocator(8)
    index = PrefixIndex(P, alloc)
    chain(index, [1, 2, 3, 4], salt=("a", 0))
    assert index.match([1, 2, 3, 4, 5], None, 9) == []
    assert index.match([1, 2, 3, 4, 5], ("a", 1), 9) == []
    assert len(index.match([1, 2, 3, 4, 5], ("a", 0), 9)) == 2
    assert len(index.match([1, 2, 3, 4], ("a", 0), 1)) == 1  # max_blocks
    assert len(index.match([1, 2, 3, 9], ("a", 0), 9)) == 1  # diverges inside block 2
    assert index.match([3, 4], ("a", 0), 9) == []  # block 2's tokens, but not after block 1
    # the same block again on another page (two sequences computed it at once): not indexed
    other = alloc.alloc(1)
    assert index.add(None, ("a", 0), [1, 2], other[0]) is None
    assert not alloc.indexed(other[0])


def test_no_prefix_cache_flag():
    import argparse

    from coordinator.main import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--model", "m"])).prefix_cache is True
    assert config_from_args(p.parse_args(["--model", "m", "--no-prefix-cache"])).prefix_cache is False
