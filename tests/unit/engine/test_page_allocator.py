import pytest

from symphony.engine.page_allocator import NULL_PAGE, OutOfPages, PageAllocator, PageError


def test_allocates_in_order_and_never_the_null_page():
    a = PageAllocator(6)
    assert a.capacity == 5 and a.num_free == 5
    assert a.allocate(3) == [1, 2, 3]
    assert a.allocate(2) == [4, 5]
    assert a.num_free == 0 and a.num_used == 5
    assert NULL_PAGE not in a._free


def test_free_gives_pages_back_exactly():
    a = PageAllocator(8)
    p = a.allocate(2)                       # [1, 2]
    assert [a.is_allocated(i) for i in p] == [True, True]
    a.free(p)
    assert a.num_free == 7 and not a.is_allocated(1) and not a.is_allocated(2)


def test_pages_for_rounds_up():
    from symphony.engine.page_allocator import pages_for
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_freed_pages_are_reused_first_lifo():
    a = PageAllocator(8)
    a.allocate(3)                           # 1, 2, 3
    a.free([2])
    assert a.allocate(2) == [2, 4]


def test_out_of_pages_takes_nothing():
    a = PageAllocator(4)
    a.allocate(2)
    with pytest.raises(OutOfPages, match="need 2 KV pages, only 1"):
        a.allocate(2)
    assert a.num_free == 1
    assert a.can_allocate(1) and not a.can_allocate(2)


def test_double_free_raises_and_changes_nothing():
    a = PageAllocator(8)
    p = a.allocate(2)
    with pytest.raises(PageError, match="double free"):
        a.free([p[0], p[0]])
    assert a.is_allocated(p[0]) and a.num_free == 5
    a.free(p)
    with pytest.raises(PageError, match="not allocated"):
        a.free([p[0]])
    with pytest.raises(PageError, match="null page"):
        a.free([NULL_PAGE])


@pytest.mark.parametrize("bad", [0, -1, 8, "1", 1.0, True])
def test_bad_page_ids_are_refused(bad):
    a = PageAllocator(8)
    a.allocate(1)
    with pytest.raises(PageError):
        a.free([bad])
    assert a.num_used == 1


def test_no_leak_after_random_workload():
    import random
    rng = random.Random(0)
    a = PageAllocator(64)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 4)
            if a.can_allocate(n):
                held.append(a.allocate(n))
        owned = [p for h in held for p in h]
        assert len(set(owned)) == len(owned) and all(a.is_allocated(p) for p in owned)
        assert a.num_used == len(owned)
    for h in held:
        a.free(h)
    assert a.num_free == a.capacity
    assert sorted(a._free) == list(range(1, 64))


def test_constructor_validates():
    with pytest.raises(ValueError):
        PageAllocator(1)
    with pytest.raises(ValueError):
        PageAllocator(8).allocate(-1)
