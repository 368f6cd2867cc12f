"""A large run's fan-out tree (no sockets): the island scheduler's sends per run stay at most ``width``.

A run whose parts go to more than ``width`` executors is not sent as one ``Enqueue`` per executor: its
executors, in the island order's sequence, are cut into at most ``width`` contiguous subtrees; the first
executor of each is its head and is sent one ``FanOut`` carrying the subtree's parts, and the rest of
the subtree is cut again the same way below it (depth ``log_width(hosts)``). Each part's ``Enqueue``
is encoded once, when the ``FanOut`` is (``FanOut.parts``), and travels down the tree as those bytes,
unread by the heads it passes (``executor/fanout.py``); it is the one the order made (its
``executor_seq`` and ``seqs`` unchanged: an executor restores the island's order whichever way a part
came), with ``report`` set to its parent head's control address ("" under the scheduler; a head's own
part reports to the head itself, whatever its ``report`` said). Completions come back up the same tree
(``executor/fanout.py``): each head sends its parent one ``PartsDone`` for its subtree, its own part
included, so the scheduler hears one message per top-level subtree per run.

``RunTree`` is what the scheduler keeps of a run's tree: which executor reports through which head,
to check a ``PartsDone`` (a top-level head speaks only for its subtree) and to know, when an executor
is gone, whose reports are lost with it.

A template's runs all have the same tree (while none of its heads is gone): ``Layout`` is worked out once
per template (``layout``), with each top-level subtree's executors, controls, sizes, parts' nodes and
places. Once every executor holds its part, a run is one ``FanOut`` per top-level subtree whose parts are
said together (``Layout.sends``: ``TemplateRun``, the run's names and first place once, per part only its
nodes and ``executor_seq``, packed), and each head makes its own ``Enqueue`` of it: each executor gets what ``build`` would
have sent it, while the scheduler's work per run is per subtree, not per executor, and nothing per
executor is encoded.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator

import numpy as np

from pwmesh.core.contract import Send
from pwmesh.errors import InvalidArgument
from pwmesh.wire.messages import PACKED, Enqueue, FanOut, TemplateRun, packed, subtree_frees

FANOUT_ENV = "PWMESH_FANOUT"
DEFAULT_FANOUT = 16  # the tree's width: a head's children, and the scheduler's sends per run
TREE_ABOVE_ENV = "PWMESH_FANOUT_ABOVE"
# A run (or a free) over more executors than this goes through a tree. Below it, direct sends cost the
# island's scheduler less: measured on the simulator (2026-11-27), a pipeline over 4 islands x 256 hosts
# whose every node reports early ran at 99% of its ideal with two steps in flight sent directly and at 74%
# through trees of 16 (each early report climbs the tree as a PartsDone of its own); Figure 5's chain at 256
# hosts was even (2,784 against 2,798 Chained computations/s), at 1,024 hosts the tree's (1,763 against 1,295).
DEFAULT_TREE_ABOVE = 256


def fanout_width(value: str | int | None = None) -> int:
    """The tree's width: ``value``, else ``$PWMESH_FANOUT``, else ``DEFAULT_FANOUT``; at least 2."""
    return _at_least_2("the fan-out width", value if value is not None else os.environ.get(FANOUT_ENV) or DEFAULT_FANOUT)


def tree_above(value: str | int | None = None) -> int:
    """How many executors a run may span and still go directly: ``value``, else ``$PWMESH_FANOUT_ABOVE``, else
    ``DEFAULT_TREE_ABOVE``; at least 2."""
    return _at_least_2("the fan-out threshold",
                       value if value is not None else os.environ.get(TREE_ABOVE_ENV) or DEFAULT_TREE_ABOVE)


def _at_least_2(what: str, raw: str | int) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise InvalidArgument(f"{what} must be an integer >= 2, got {raw!r}") from None
    if n < 2:
        raise InvalidArgument(f"{what} must be an integer >= 2, got {n}")
    return n


@dataclasses.dataclass(slots=True, eq=False)
class RunTree:
    """One run's tree, in preorder: ``executors[i]``'s subtree is ``[i, i + sizes[i])``; ``parents[i]`` the
    index of its head (-1: the scheduler)."""

    executors: list[str]
    controls: list[str]
    sizes: list[int]
    parents: list[int]
    index: dict[str, int]
    # Top-level head -> the executors that report through it (made when first asked: a template's runs share it).
    _subtrees: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def subtree(self, head: str) -> frozenset[str]:
        """The executors whose reports come up through ``head`` if it is a top-level head, itself included
        (else none)."""
        found = self._subtrees.get(head)
        if found is None:
            h = self.index.get(head)
            found = frozenset() if h is None or self.parents[h] >= 0 or self.sizes[h] < 2 else \
                frozenset(self.executors[h:h + self.sizes[h]])
            self._subtrees[head] = found
        return found

    def below(self, executor_id: str) -> list[str]:
        """The executors whose reports pass through ``executor_id`` (its subtree, itself excluded)."""
        i = self.index.get(executor_id)
        return [] if i is None else self.executors[i + 1:i + self.sizes[i]]

    def reports_for(self, head: str, executor_id: str) -> bool:
        """Whether ``executor_id``'s reports come up through top-level head ``head`` (its own do, if it heads
        a subtree)."""
        h, i = self.index.get(head), self.index.get(executor_id)
        return h is not None and i is not None and self.parents[h] < 0 and h <= i < h + self.sizes[h] \
            and self.sizes[h] > 1

    def parent(self, executor_id: str) -> tuple[str, str] | None:
        """The head ``executor_id`` reports to, and where it is reached; None: the scheduler (or not here)."""
        i = self.index.get(executor_id)
        if i is None or self.parents[i] < 0:
            return None
        p = self.parents[i]
        return self.executors[p], self.controls[p]

    def heads(self) -> Iterator[str]:
        return (ex for ex, size in zip(self.executors, self.sizes, strict=True) if size > 1)


@functools.lru_cache(maxsize=64)
def preorder(n: int, width: int) -> tuple[list[int], list[int]]:
    """Items ``0..n-1`` as a forest of at most ``width`` subtrees, each head's children cut the same way:
    the items in preorder (here: their own order) and each one's subtree size. Cached: never change them."""
    sizes = [1] * n

    def forest(lo: int, hi: int) -> None:
        count = hi - lo
        chunks = min(width, count)
        for c in range(chunks):
            a, b = lo + count * c // chunks, lo + count * (c + 1) // chunks
            sizes[a] = b - a
            if b - a > 1:
                forest(a + 1, b)

    forest(0, n)
    return list(range(n)), sizes


def frees(buffers: list[str], controls: list[str], width: int, stimulus: str = "",
          last: Callable[[str], bool] | None = None) -> list[Send]:
    """The island's frees of ``buffers`` on every executor at ``controls``, as at most ``width`` sends: a
    ``FanOutFrees`` to each subtree's head (a subtree of one: its ``DeleteShards``). Controls ``last``
    says are gone are put last, so they are leaves (a head gone would take its subtree's frees with it);
    None: none is gone. Its work is per subtree, not per executor."""
    if last is not None:
        controls = sorted(controls, key=last)  # (stable: the rest keep their order)
    _, sizes = preorder(len(controls), width)
    return [Send(to, message, stimulus) for to, message in subtree_frees(buffers, controls, sizes)]


def build(run_id: str, sends: list[Send], executor_of: Callable[[str], str], width: int, scheduler: str,
          lost: Callable[[str], bool] = lambda _: False) -> tuple[list[Send], RunTree]:
    """One run's ``Enqueue`` sends (all of it, in order) as at most ``width`` sends: ``FanOut`` to each
    subtree's head (a subtree of one: its ``Enqueue``). ``executor_of``: an executor's id by its control
    address; ``lost``: executors known gone are never made heads where another can be."""
    items = [(executor_of(s.to), s.to, s.message) for s in sends]
    executors: list[str] = []
    controls: list[str] = []
    parts: list[Enqueue] = []
    sizes: list[int] = []
    parents: list[int] = []

    def forest(lo: int, hi: int, parent: int, report: str) -> None:
        n = hi - lo
        chunks = min(width, n)
        for c in range(chunks):
            a, b = lo + n * c // chunks, lo + n * (c + 1) // chunks
            if b - a > 1 and lost(items[a][0]):  # a head that is gone would take its subtree with it
                alive = next((j for j in range(a + 1, b) if not lost(items[j][0])), a)
                items[a], items[alive] = items[alive], items[a]
            ex, control, enqueue = items[a]
            assert isinstance(enqueue, Enqueue)
            enqueue.report = report  # made for this send by the order: never shared
            i = len(executors)
            executors.append(ex)
            controls.append(control)
            parts.append(enqueue)
            sizes.append(1)
            parents.append(parent)
            if b - a > 1:
                forest(a + 1, b, i, control)
                sizes[i] = len(executors) - i

    forest(0, len(items), -1, "")
    out: list[Send] = []
    stimulus = sends[0].stimulus if sends else ""
    i = 0
    while i < len(executors):
        size = sizes[i]
        if size == 1:
            out.append(Send(controls[i], parts[i], stimulus))
        else:
            out.append(Send(controls[i], FanOut(run_id=run_id, parent=scheduler, bodies=[], parts=parts[i:i + size],
                                                executors=executors[i:i + size], controls=controls[i:i + size],
                                                sizes=sizes[i:i + size]), stimulus))
        i += size
    return out, RunTree(executors, controls, sizes, parents, {ex: k for k, ex in enumerate(executors)})


@dataclasses.dataclass(slots=True, eq=False)
class _Top:
    """A top-level subtree of a ``Layout``, as each run's ``FanOut`` to its head carries it (never changed:
    every run's message shares these)."""

    first: int  # its first part
    end: int
    offset: int  # its first part's first place in a run, from the run's first
    control: str  # its head's
    executors: list[str]
    controls: list[str]
    sizes: list[int]
    counts: bytes  # its parts' node counts and nodes, packed (``TemplateRun``)
    nodes: bytes


@dataclasses.dataclass(slots=True, eq=False)
class Layout:
    """The tree every run of one template goes through (its parts in the template's order, none of its heads
    gone): ``build``'s tree, worked out once. ``tree`` is shared by the runs (never changed)."""

    tree: RunTree
    heads: frozenset[str]  # the executors that head a subtree: the layout holds while none of them is gone
    tops: list[_Top]  # the top-level subtrees, in order
    width: int
    # What the order keeps of a run in flight (``order.py``): the executors that report to the scheduler
    # themselves (subtrees of one), and each top-level head's subtree, itself included (what one
    # ``PartsDone`` of it ends), with the head each executor in it reports through.
    lone: list[str] = dataclasses.field(default_factory=list)
    below: dict[str, tuple[frozenset[str], list[str]]] = dataclasses.field(default_factory=dict)
    top_of: dict[str, str] = dataclasses.field(default_factory=dict)

    def sends(self, run_id: str, proxy: str, names: list[str], scheduler: str, epoch: str, template: str, seq: int,
              executor_seqs: np.ndarray, stimulus: str) -> list[Send]:
        """A run of template ``template`` whose first place in the island order is ``seq``: a ``FanOut`` to each
        top-level head (a subtree of one: to the executor itself) with its subtree's parts said together
        (``TemplateRun``), part ``i``'s ``executor_seq`` ``executor_seqs[i]``. Each executor gets the
        ``Enqueue`` that ``build`` would send it; the work here is per subtree, not per executor."""
        out: list[Send] = []
        for top in self.tops:
            run = TemplateRun(proxy=proxy, names=names, scheduler=scheduler, epoch=epoch, template=template,
                              seq=seq + top.offset, counts=top.counts, nodes=top.nodes,
                              executor_seqs=executor_seqs[top.first:top.end].astype(PACKED, copy=False).tobytes())
            out.append(Send(top.control, FanOut(run_id=run_id, parent=scheduler, bodies=[], executors=top.executors,
                                                controls=top.controls, sizes=top.sizes, run=run), stimulus))
        return out


def layout(executors: list[str], controls: list[str], width: int, nodes: list[list[int]]) -> Layout:
    """The tree ``build`` makes of parts for ``executors`` (at ``controls``, with ``nodes``, whose places in a
    run follow one another in this order), in this order, none gone."""
    n = len(executors)
    sizes = list(preorder(n, width)[1])
    parents = [-1] * n
    open_heads: list[tuple[int, int]] = []  # (head, the end of its subtree), innermost last
    for i in range(n):
        while open_heads and i >= open_heads[-1][1]:
            open_heads.pop()
        if open_heads:
            parents[i] = open_heads[-1][0]
        if sizes[i] > 1:
            open_heads.append((i, i + sizes[i]))
    tops = []
    i = offset = 0
    while i < n:
        j = i + sizes[i]
        mine = nodes[i:j]
        tops.append(_Top(i, j, offset, controls[i], executors[i:j], controls[i:j], sizes[i:j],
                         packed([len(m) for m in mine]), packed([node for m in mine for node in m])))
        offset += sum(len(m) for m in mine)
        i = j
    tree = RunTree(list(executors), list(controls), sizes, parents, {ex: k for k, ex in enumerate(executors)})
    found = Layout(tree, frozenset(ex for ex, size in zip(executors, sizes, strict=True) if size > 1), tops, width)
    for top in tops:
        if top.end - top.first == 1:
            found.lone.append(top.executors[0])
        else:
            found.below[top.executors[0]] = (frozenset(top.executors), top.executors)
            found.top_of.update((ex, top.executors[0]) for ex in top.executors)
    return found
