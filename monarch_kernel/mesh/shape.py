"""Shapes, points, value meshes and process meshes.

A mesh is an array of ranks with named dimensions, as in PyTorch Monarch:
``{"hosts": 2, "procs": 4}`` is 8 ranks numbered row-major (host-major).
Slicing by dimension (``mesh.slice(procs=0)``, ``mesh.slice(procs=slice(0,
2))``) gives a smaller mesh over the same processes; an integer index drops
its dimension. A :class:`ValueMesh` holds one value per point of a shape;
a :class:`ProcMesh` is a mesh of worker processes.
"""

from __future__ import annotations

import html
import itertools
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any

from monarch_kernel.errors import MeshError, RankSpecError

__all__ = ["MISSING", "Point", "Shape", "ValueMesh", "parse_ranks"]


class Shape:
    """Named dimensions over a list of global ranks (row-major).

    Parameters
    ----------
    dims : mapping of str to int
        Dimension names and sizes, outermost first.
    ranks : list of int, optional
        The global rank at each point, row-major; ``range(size)`` by default.

    Raises
    ------
    MeshError
        For a name that is not a string, a size that is not a whole number
        >= 1 (``"4"``, ``2.0`` and ``True`` are refused), or a rank list of
        the wrong length.
    """

    def __init__(self, dims: Mapping[str, int], ranks: list[int] | None = None) -> None:
        for name, v in dims.items():
            if not isinstance(name, str):
                raise MeshError(f"dimension names are strings, like {{'procs': 4}}; got {name!r}")
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise MeshError(f"dimension {name!r} has size {v!r} (a {type(v).__name__}); "
                                "sizes are whole numbers >= 1, like {'procs': 4}")
        self.labels: tuple[str, ...] = tuple(dims)
        self.sizes: tuple[int, ...] = tuple(int(v) for v in dims.values())
        for name, size in zip(self.labels, self.sizes, strict=True):
            if size < 1:
                raise MeshError(f"dimension {name!r} has size {size}; sizes must be >= 1")
        n = math.prod(self.sizes)
        self.ranks: list[int] = list(range(n)) if ranks is None else list(ranks)
        if len(self.ranks) != n:
            raise MeshError(f"shape {dict(self.dims)} has {n} points but {len(self.ranks)} ranks")

    @property
    def dims(self) -> dict[str, int]:
        """``{name: size}``, outermost first."""
        return dict(zip(self.labels, self.sizes, strict=True))

    def __len__(self) -> int:
        return len(self.ranks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and (self.dims, self.ranks) == (other.dims, other.ranks)

    def __repr__(self) -> str:
        return f"Shape({self.dims})"

    def coords(self) -> Iterator[dict[str, int]]:
        """Every point's coordinates, row-major."""
        for idx in itertools.product(*(range(s) for s in self.sizes)):
            yield dict(zip(self.labels, idx, strict=True))

    def points(self) -> Iterator[Point]:
        for c, r in zip(self.coords(), self.ranks, strict=True):
            yield Point(c, r)

    def slice(self, **selectors: int | slice) -> Shape:
        """A sub-shape; an int drops its dimension, a slice keeps it.

        Raises
        ------
        MeshError
            For an unknown dimension, an index out of range or an empty slice.
        """
        for name in selectors:
            if name not in self.labels:
                raise MeshError(f"no dimension {name!r} in shape {self.dims}")
        keep: list[tuple[str, list[int]]] = []
        per_dim: list[list[int]] = []
        for name, size in zip(self.labels, self.sizes, strict=True):
            sel = selectors.get(name, slice(None))
            if isinstance(sel, slice):
                idx = list(range(size))[sel]
                if not idx:
                    raise MeshError(f"slice {sel} of dimension {name!r} (size {size}) is empty")
                keep.append((name, idx))
            else:
                i = int(sel)
                if not -size <= i < size:
                    raise MeshError(f"index {i} is out of range for {name!r} (size {size})")
                idx = [i % size]
            per_dim.append(idx)
        strides = [math.prod(self.sizes[i + 1:]) for i in range(len(self.sizes))]
        ranks = [
            self.ranks[sum(i * s for i, s in zip(combo, strides, strict=True))]
            for combo in itertools.product(*per_dim)
        ]
        return Shape({n: len(ix) for n, ix in keep}, ranks)


class Point(Mapping[str, int]):
    """A point of a mesh: its coordinates (a mapping) and its global rank.

    Attributes
    ----------
    rank : int
        The global rank (the worker process's rank).
    """

    __slots__ = ("_coords", "rank")

    def __init__(self, coords: Mapping[str, int], rank: int) -> None:
        self._coords = dict(coords)
        self.rank = rank

    def __getitem__(self, k: str) -> int:
        return self._coords[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        c = ", ".join(f"{k}={v}" for k, v in self._coords.items())
        return f"Point(rank={self.rank}, {c})" if c else f"Point(rank={self.rank})"

    def __reduce__(self) -> tuple:
        return (Point, (self._coords, self.rank))


class _Missing:
    """The type of :data:`MISSING` (one instance; false; pickles as itself)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<missing>"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "MISSING"


#: The value, in a :class:`ValueMesh`, of a point that has none: a rank that
#: died or did not answer (``err.partial`` of a call that failed). Test with
#: ``v is MISSING``; :attr:`ValueMesh.missing` lists those ranks.
MISSING = _Missing()


class ValueMesh:
    """One value per point of a shape (what a mesh-wide call returns).

    Parameters
    ----------
    shape : Shape
    values : list
        Values in the shape's row-major order; :data:`MISSING` where a point has
        no value (the ranks that did not answer a call that failed).
    """

    def __init__(self, shape: Shape, values: list[Any]) -> None:
        if len(values) != len(shape):
            raise MeshError(f"{len(values)} values for a shape of {len(shape)} points")
        self.shape = shape
        self._values = list(values)

    @property
    def sizes(self) -> dict[str, int]:
        return self.shape.dims

    def __len__(self) -> int:
        return len(self._values)

    def values(self) -> list[Any]:
        """The values, row-major (rank order for a whole mesh)."""
        return list(self._values)

    @property
    def missing(self) -> list[int]:
        """The ranks whose value is :data:`MISSING` (none for a call that succeeded)."""
        return [r for r, v in zip(self.shape.ranks, self._values, strict=True) if v is MISSING]

    def items(self) -> Iterator[tuple[Point, Any]]:
        """``(Point, value)`` pairs, row-major."""
        return zip(self.shape.points(), self._values, strict=True)

    def item(self, **coords: int) -> Any:
        """The value at one point, e.g. ``vm.item(procs=1)``.

        Raises
        ------
        MeshError
            Unless ``coords`` name exactly one point.
        """
        sub = self.shape.slice(**coords)
        if len(sub) != 1 or sub.labels:
            raise MeshError(f"item() needs every dimension of {self.shape.dims}, got {coords}")
        return self._values[self.shape.ranks.index(sub.ranks[0])]

    def slice(self, **selectors: int | slice) -> ValueMesh:
        sub = self.shape.slice(**selectors)
        pos = {r: i for i, r in enumerate(self.shape.ranks)}
        return ValueMesh(sub, [self._values[pos[r]] for r in sub.ranks])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ValueMesh) and self.shape == other.shape
                and self._values == other._values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def _rows(self) -> list[tuple[list[str], str]]:
        rows = []
        for p, v in self.items():
            text = _short_repr(v)
            rows.append(([str(p.rank), *(str(p[k]) for k in self.shape.labels)], text))
        return rows

    def __repr__(self) -> str:
        head = ["rank", *self.shape.labels]
        rows = self._rows()
        widths = [max(len(h), *(len(r[0][i]) for r in rows)) for i, h in enumerate(head)]
        lines = [f"ValueMesh({self.shape.dims}):"]
        lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))
                     + "  value")
        for cells, text in rows:
            pad = "  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + "  "
            first, *rest = text.splitlines() or [""]
            lines.append(pad + first)
            lines.extend(" " * len(pad) + ln for ln in rest)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in ["rank", *self.shape.labels])
        body = "".join(
            "<tr>" + "".join(f"<td>{c}</td>" for c in cells)
            + f"<td style='text-align:left'><pre style='margin:0'>{html.escape(text)}</pre></td>"
            "</tr>"
            for cells, text in self._rows()
        )
        return (f"<div><b>ValueMesh</b> {html.escape(str(self.shape.dims))}"
                f"<table><thead><tr>{head}<th>value</th></tr></thead>"
                f"<tbody>{body}</tbody></table></div>")


def _short_repr(v: Any, limit: int = 2000) -> str:
    try:
        text = repr(v)
    except Exception as e:  # noqa: BLE001 - a broken __repr__ must not break the table
        text = f"<unrepresentable {type(v).__name__}: {e}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """Parse a rank spec: ``"0"``, ``"1,3"``, ``"0:2"`` (half-open), ``"all"``,
    or mixtures like ``"0:2,5"``.

    Ranges are checked against ``world_size`` before any rank of them is made,
    so the work and memory are bounded by the mesh's size, whatever the spec
    says (``0:1000000000`` is refused at once).

    Returns
    -------
    list of int
        Each rank once, in the order the spec names them.

    Raises
    ------
    RankSpecError
        For syntax errors, ranks outside ``0..world_size-1``, or empty ranges.
    """
    spec = spec.strip()
    if spec in ("all", "*", ""):
        return list(range(world_size))
    last = world_size - 1
    out: list[int] = []
    seen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                a, _, b = part.partition(":")
                lo = int(a) if a.strip() else 0
                hi = int(b) if b.strip() else world_size
            else:
                lo = int(part)
                hi = lo + 1
        except ValueError:
            raise RankSpecError(
                f"bad rank spec {spec!r}; use a rank (2), a list (1,3) or a range (0:2)"
            ) from None
        if not 0 <= lo <= last:
            raise RankSpecError(f"rank {lo} does not exist: this mesh has ranks 0 to {last}")
        if ":" in part and lo >= hi:
            raise RankSpecError(
                f"rank range {part!r} is empty; write START:STOP with START < STOP "
                f"(STOP excluded), e.g. 0:{world_size}"
            )
        if hi - 1 > last:
            raise RankSpecError(
                f"rank range {part!r} runs past the last rank: this mesh has ranks 0 to "
                f"{last} (write e.g. {lo}:{world_size})")
        for r in range(lo, hi):  # (at most world_size ranks: checked above)
            if r not in seen:
                seen.add(r)
                out.append(r)
    return out
