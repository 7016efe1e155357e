"""The machine of the I/O model: a fast memory of ``M`` words that counts loads and stores.

:class:`TwoLevelMemory` is the machine, :class:`FastMemoryOverflow` what it raises when an
algorithm asks for more than ``M`` words, :class:`IOCount` what an algorithm run on it moved.
The package's docstring (:mod:`sdpa.iomodel`) describes the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_positive_int

__all__ = ["FastMemoryOverflow", "IOCount", "TwoLevelMemory"]


class FastMemoryOverflow(MemoryError):
    """An algorithm asked fast memory to hold more words than its capacity ``M``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import FastMemoryOverflow, TwoLevelMemory
    >>> memory = TwoLevelMemory(capacity=4)
    >>> try:
    ...     memory.load("x", np.zeros(5))
    ... except FastMemoryOverflow:
    ...     print("5 words do not fit in 4")
    5 words do not fit in 4
    """


class TwoLevelMemory:
    """Fast memory of ``capacity`` words in front of an unbounded slow memory.

    Slow memory is any NumPy array. An algorithm copies a part of one into fast memory with
    :meth:`load`, places a result it computed there with :meth:`hold`, copies a fast array
    back into slow memory with :meth:`store` and releases space with :meth:`free`. Every array
    in fast memory has a name; giving a name again replaces its array.

    Parameters
    ----------
    capacity : int
        ``M``, the number of words (array elements) fast memory can hold; positive.

    Attributes
    ----------
    capacity : int
        ``M``.
    loads, stores : int
        Words copied from slow to fast memory, and from fast to slow memory, so far.
    peak : int
        The most words fast memory has held at once.

    Raises
    ------
    TypeError
        If ``capacity`` is not an integer.
    ValueError
        If ``capacity`` is not positive.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import TwoLevelMemory
    >>> slow = np.arange(12.0).reshape(3, 4)
    >>> mem = TwoLevelMemory(capacity=10)
    >>> row = mem.load("row", slow[1])  # 4 words in
    >>> total = mem.hold("total", row.sum(keepdims=True))  # computed in fast memory: free
    >>> mem.store("total", slow[0, :1])  # 1 word out
    >>> mem.loads, mem.stores, mem.used, mem.peak
    (4, 1, 5, 5)
    >>> float(slow[0, 0])
    22.0

    Asking for more than ``M`` words raises:

    >>> mem.load("two rows", slow[1:])
    Traceback (most recent call last):
    ...
    sdpa.iomodel.machine.FastMemoryOverflow: fast memory of 10 words cannot hold 'two rows' (8 words) ...
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = check_positive_int(capacity, "capacity", unit="words")
        self.loads = 0
        self.stores = 0
        self.peak = 0
        self._fast: dict[str, np.ndarray] = {}
        self._used = 0

    @property
    def used(self) -> int:
        """Words held in fast memory now."""
        return self._used

    @property
    def words_moved(self) -> int:
        """``loads + stores``: the traffic between the two memories."""
        return self.loads + self.stores

    def __contains__(self, name: str) -> bool:
        return name in self._fast

    def __getitem__(self, name: str) -> np.ndarray:
        return self._fast[self._check_name(name)]

    def _check_name(self, name) -> str:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string; got {name!r}")
        if name not in self._fast:
            held = ", ".join(self._fast) or "nothing"
            raise ValueError(f"{name!r} is not in fast memory, which holds: {held}")
        return name

    def _place(self, name: str, value: np.ndarray) -> np.ndarray:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string; got {name!r}")
        replaced = self._fast[name].size if name in self._fast else 0
        if self._used - replaced + value.size > self.capacity:
            others = ", ".join(f"{n}: {a.size}" for n, a in self._fast.items() if n != name)
            raise FastMemoryOverflow(
                f"fast memory of {self.capacity} words cannot hold {name!r} ({value.size} "
                f"words) beside the {self._used - replaced} words it holds already ({others})"
            )
        self._fast[name] = value
        self._used += value.size - replaced
        self.peak = max(self.peak, self._used)
        return value

    def load(self, name: str, source: ArrayLike) -> np.ndarray:
        """Copy ``source`` (a part of slow memory) into fast memory as ``name``; count its words.

        Returns the copy in fast memory: changing it does not change slow memory.
        """
        value = np.array(source, dtype=np.float64, copy=True)
        self._place(name, value)
        self.loads += value.size
        return value

    def hold(self, name: str, value: ArrayLike) -> np.ndarray:
        """Place ``value``, computed from arrays in fast memory, there as ``name``; no traffic.

        Returns the array held, which the algorithm may then update in place.
        """
        return self._place(name, np.array(value, dtype=np.float64, copy=True))

    def store(self, name: str, target: np.ndarray) -> None:
        """Copy the fast array ``name`` into ``target`` (a view of slow memory); count its words."""
        value = self._fast[self._check_name(name)]
        if not isinstance(target, np.ndarray) or target.shape != value.shape:
            shape = getattr(target, "shape", type(target).__name__)
            raise ValueError(
                f"target must be a NumPy array (a view of slow memory) of the shape of "
                f"{name!r}, {value.shape}; got {shape}"
            )
        target[...] = value
        self.stores += value.size

    def free(self, *names: str) -> None:
        """Release the named arrays' space; freeing a name that is not held is an error."""
        for name in names:
            self._used -= self._fast.pop(self._check_name(name)).size


@dataclass(frozen=True)
class IOCount:
    """What an algorithm moved on a :class:`TwoLevelMemory`, and what it computed.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import flash_attention_io
    >>> x = np.ones((8, 2))
    >>> count = flash_attention_io(x, x, x, capacity=64)
    >>> count.words == count.loads + count.stores
    True
    """

    algorithm: str
    out: np.ndarray  # (T, Dv), the attention output the algorithm computed
    loads: int
    stores: int
    peak: int  # most words in fast memory at once, at most the capacity
    block_q: int  # Br, query rows per block
    block_k: int  # Bc, keys per block

    @property
    def words(self) -> int:
        """``loads + stores``, the words moved between slow and fast memory."""
        return self.loads + self.stores
