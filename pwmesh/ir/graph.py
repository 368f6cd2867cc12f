"""Questions about a program's graph that the client and the proxy both ask (pure: no sockets, no JAX)."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from pwmesh.wire.messages import ProgramSpec


def ancestors(program: ProgramSpec) -> list[set[int]]:
    """For each node, the nodes it depends on, directly or not (nodes are in dataflow order)."""
    producer = {v: i for i, node in enumerate(program.nodes) for v in node.outputs}
    out: list[set[int]] = []
    for node in program.nodes:
        above: set[int] = set()
        for v in node.inputs:
            p = producer.get(v)
            if p is not None and p not in above:
                above.add(p)
                above |= out[p]
        out.append(above)
    return out


def donation_error(program: ProgramSpec, names: Sequence[str] | None = None) -> str | None:
    """Why a donation in ``program`` is unsafe, or ``None`` (``names``: what to call each node in it).

    A node may consume (be donated) a value that other nodes of the program also read only when
    every one of them comes before it in the dataflow: they have run by the time it can start, as
    in a training step that reads its parameters in each microbatch and then updates them in place.
    A value the program returns cannot be donated (and two calls given the same value are refused
    as the first one's later reader)."""
    def name(i: int) -> str:
        return f"node {i}" if names is None else f"{names[i]} (node {i})"

    readers: dict[int, list[int]] = collections.defaultdict(list)
    for i, node in enumerate(program.nodes):
        for v in dict.fromkeys(node.inputs):
            readers[v].append(i)
    outputs = set(program.outputs)
    above: list[set[int]] | None = None
    for i, node in enumerate(program.nodes):
        for k in node.donate:
            v = node.inputs[k]
            if v in outputs:
                return f"{name(i)} is donated a value the program also returns"
            if node.inputs.count(v) > 1:
                return f"{name(i)} is donated a value it also reads as another argument"
            others = [r for r in readers[v] if r != i]
            if not others:
                continue
            if above is None:
                above = ancestors(program)
            late = [r for r in others if r not in above[i]]
            if late:
                return (f"{name(i)} is donated a value that {name(late[0])} also reads and may not have read "
                        "yet (it does not come before it in the dataflow): a donated buffer is consumed when the "
                        "call it is given to runs")
    return None
