import pytest

from jaxpd.engine.scheduling.page_allocator import OutOfPages, PageAllocator, pages_for


def test_null_page_is_never_handed_out():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert alloc.num_free == 0 and not alloc.can_allocate(1)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_free_returns_pages_and_rejects_double_free():
    alloc = PageAllocator(4)
    a = alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.num_used == 0
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([0])


def test_allocation_is_exclusive():
    alloc = PageAllocator(9)
    a, b = alloc.allocate(3), alloc.allocate(5)
    assert not set(a) & set(b)
    assert alloc.num_used == 8


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1)
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(-1)


@pytest.mark.parametrize("tokens,size,expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1),
                                                  (17, 16, 2), (100, 8, 13)])
def test_pages_for(tokens, size, expected):
    assert pages_for(tokens, size) == expected
