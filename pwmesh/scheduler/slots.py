"""The island's device slots, counted per cell (no sockets): what ``order.py`` checks a run's window against.

A run may start when every device it touches has fewer than ``window`` runs in flight. Counted per
device, every decision costs as many steps as the run has devices (16 for a gang over two executors
of 8), and so does every completion. But devices that every footprint in use holds either whole or
not at all always carry the same count: they are counted once, as a *cell* (a set of devices of one
executor). A footprint (``Shape``) is the list of its cells, so a run of a program over whole
executors costs one step per executor, whatever their device count.

A new footprint that holds part of a cell splits it: both halves keep its count, and every footprint
that held the cell now holds both. Footprints no queued or running run uses are kept for reuse (the
newest ``idle_shapes``); beyond that the oldest is forgotten, and with it every cell no footprint
holds any more (idle: its count is 0). Cells are never merged back, so at worst (footprints that
overlap every way) a cell is one device, as when every device was counted.

A cell also keeps the fair order's clients whose head run waits for one of its slots
(``order.py``: ``blocked``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

DeviceKey = tuple[str, int]  # (executor_id, device)


class Cell:
    """Devices of one executor that every footprint in use holds whole or not at all: one count for all."""

    __slots__ = ("executor", "devices", "busy", "blocked", "shapes")

    def __init__(self, executor: str, devices: set[DeviceKey], busy: int) -> None:
        self.executor = executor
        self.devices = devices
        self.busy = busy  # runs in flight on each of its devices
        self.blocked: list[Any] = []  # a heap of the order's waiting entries this cell's window holds back
        self.shapes: set[Shape] = set()  # the footprints that hold it


class Shape:
    """A footprint, interned, as cells (in all, and by executor): its devices are the cells' (each is
    kept once, in its cell, however many footprints hold it)."""

    __slots__ = ("key", "cells", "by_executor", "users", "version", "_flat")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.cells: list[Cell] = []
        self.by_executor: dict[str, list[Cell]] = {}
        self.users = 0  # runs queued or in flight with this footprint
        self.version = 0  # bumped when it gains a cell (a split): what was worked out of its cells is stale
        self._flat: dict[Hashable, tuple[int, list[Cell]]] = {}

    def cells_of(self, key: Hashable, executors: list[str]) -> list[Cell]:
        """The cells ``executors`` hold in it, in one list (kept under ``key`` until it gains a cell)."""
        found = self._flat.get(key)
        if found is None or found[0] != self.version:
            by = self.by_executor
            found = self._flat[key] = (self.version, [cell for ex in executors for cell in by.get(ex, ())])
        return found[1]

    @property
    def devices(self) -> frozenset[DeviceKey]:
        """Every (executor, device) it holds (built when asked: for checks, not for the order's work)."""
        return frozenset().union(*(cell.devices for cell in self.cells))

    def add(self, cell: Cell) -> None:
        self.version += 1
        self.cells.append(cell)
        self.by_executor.setdefault(cell.executor, []).append(cell)
        cell.shapes.add(self)


class Slots:
    """Every device's runs in flight, by cell; footprints interned by a key the caller derives cheaply."""

    def __init__(self, idle_shapes: int = 1024) -> None:
        self.idle_shapes = idle_shapes
        self._cells: dict[DeviceKey, Cell] = {}
        self._shapes: dict[Hashable, Shape] = {}
        self._idle: collections.OrderedDict[Hashable, Shape] = collections.OrderedDict()  # users == 0, oldest first

    def take(self, key: Hashable, devices: Callable[[], frozenset[DeviceKey]]) -> Shape:
        """The footprint ``key`` names (``devices()`` is called only for a key not seen), with one more user."""
        shape = self.known(key)
        if shape is None:
            shape = self._shapes[key] = self._intern(key, devices())
            shape.users += 1
        return shape

    def known(self, key: Hashable) -> Shape | None:
        """The footprint ``key`` names, with one more user, if it is kept (None: not seen, or forgotten)."""
        shape = self._shapes.get(key)
        if shape is not None:
            if not shape.users:
                del self._idle[key]
            shape.users += 1
        return shape

    def drop(self, shape: Shape) -> None:
        """A run with ``shape`` is gone (done): one user fewer; an unused footprint is kept a while."""
        shape.users -= 1
        if shape.users:
            return
        self._idle[shape.key] = shape
        while len(self._idle) > self.idle_shapes:
            _, old = self._idle.popitem(last=False)
            del self._shapes[old.key]
            for cell in old.cells:
                cell.shapes.discard(old)
                if not cell.shapes:  # no footprint in use or kept holds it, so no run does: busy is 0
                    for device in cell.devices:
                        del self._cells[device]

    def _intern(self, key: Hashable, devices: frozenset[DeviceKey]) -> Shape:
        shape = Shape(key)
        touched: dict[Cell, list[DeviceKey]] = {}
        fresh: dict[str, list[DeviceKey]] = {}
        for device in devices:
            cell = self._cells.get(device)
            if cell is None:
                fresh.setdefault(device[0], []).append(device)
            else:
                touched.setdefault(cell, []).append(device)
        for cell, held in touched.items():
            shape.add(cell if len(held) == len(cell.devices) else self._split(cell, held))
        for executor, held in fresh.items():
            cell = Cell(executor, set(held), 0)
            for device in held:
                self._cells[device] = cell
            shape.add(cell)
        return shape

    def _split(self, cell: Cell, held: list[DeviceKey]) -> Cell:
        """``held`` (part of ``cell``) becomes a cell of its own, with the same count. Waiting entries stay
        on ``cell``: it is as full as it was, and an entry waits on any full cell of its head's footprint."""
        part = Cell(cell.executor, set(held), cell.busy)
        cell.devices.difference_update(held)
        for device in held:
            self._cells[device] = part
        for shape in cell.shapes:  # each held all of ``cell``, so holds the part too
            shape.add(part)
        return part

    def busy(self) -> Mapping[DeviceKey, int]:
        """Runs in flight per device (a read-only view; a device with none reads 0)."""
        return _BusyView(self._cells)


class _BusyView(Mapping[DeviceKey, int]):
    def __init__(self, cells: dict[DeviceKey, Cell]) -> None:
        self._cells = cells

    def __getitem__(self, key: DeviceKey) -> int:
        cell = self._cells.get(key)
        return cell.busy if cell is not None else 0

    def __contains__(self, key: object) -> bool:
        cell = self._cells.get(key)  # type: ignore[call-overload]
        return cell is not None and cell.busy > 0

    def __iter__(self) -> Iterator[DeviceKey]:
        return (key for key, cell in self._cells.items() if cell.busy)

    def __len__(self) -> int:
        return sum(1 for cell in self._cells.values() if cell.busy)
