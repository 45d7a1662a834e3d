"""First-fit free extents of a shared-memory segment (the path engine's arena and the
device channels' regions)."""

from __future__ import annotations

import bisect

__all__ = ["FreeList"]


class FreeList:
    """Free extents sorted by offset; neighbours are joined when one is given back."""

    __slots__ = ("sizes", "starts")

    def __init__(self, start: int, size: int) -> None:
        self.starts = [start]
        self.sizes = [size]

    def take(self, size: int) -> int | None:
        """The offset of ``size`` bytes taken from the first extent that fits, or None."""
        sizes = self.sizes
        for i, free in enumerate(sizes):
            if free >= size:
                offset = self.starts[i]
                if free == size:
                    del self.starts[i], sizes[i]
                else:
                    self.starts[i] += size
                    sizes[i] -= size
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        """``size`` bytes at ``offset`` are free again."""
        starts, sizes = self.starts, self.sizes
        i = bisect.bisect_left(starts, offset)
        if i > 0 and starts[i - 1] + sizes[i - 1] == offset:  # joins the one before
            i -= 1
            sizes[i] += size
        else:
            starts.insert(i, offset)
            sizes.insert(i, size)
        if i + 1 < len(starts) and starts[i] + sizes[i] == starts[i + 1]:  # and the next
            sizes[i] += sizes.pop(i + 1)
            del starts[i + 1]
