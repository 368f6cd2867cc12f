"""What a fan-out head's relay really costs, with the real codec (``python -m pwmesh.sim.relay_cost``):
the figures behind ``CostModel.relay_seconds``, ``relay_body_seconds`` and ``relay_together_seconds``.

A head at the top of a 1,024-executor tree (width 16: 64 parts) and heads below it (4 parts; a leaf: 1)
are timed doing what the executor's shell and ``FanOutRelay`` do with a ``FanOut``: decode its frames,
decode the head's own part, cut the rest into its children's ``FanOut``s and encode each, and, for
comparison, every part decoded and re-encoded for the children; each for a warm template run's parts said
together (``TemplateRun``) and for parts as bodies. The model is then fitted as a fixed cost per message
handled whole plus a cost per part carried in or out.
"""

from __future__ import annotations

import statistics
import time

from pwmesh.executor.fanout import FanOutRelay
from pwmesh.scheduler.tree import preorder
from pwmesh.wire.codec import decode, encode
from pwmesh.wire.messages import Enqueue, FanOut, RunPartDone, TemplateRun, packed


def _enqueue(i: int) -> Enqueue:
    """A warm Chained run's part as the order makes it (~300 bytes: 16 nodes, their seqs, a template's)."""
    return Enqueue(run_id="run-00042#3", proxy="tcp://10.0.0.1:5555", nodes=list(range(16)), computations=b"",
                   seqs=list(range(9000 + 16 * i, 9016 + 16 * i)), names=[f"c1/b{k}" for k in range(4)],
                   scheduler="tcp://10.0.0.2:6000", executor_seq=1234 + i, epoch="9f86d081884c7d65",
                   template="5a3b9c0d1e2f3a4b", refs=[0, 1, 2, 3], report=f"tcp://10.0.1.{i % 250}:7000")


def subtree_fanout(parts: int, width: int = 16, together: bool = False) -> FanOut:
    """The ``FanOut`` for a subtree of ``parts`` executors (its children cut ``width`` ways, as ``tree.py``
    does), as the scheduler sends it: at 1,024 hosts and width 16, a top-level head's is of 64 parts, the
    heads' below it of 4, a leaf's of 1. ``together``: a warm template run's, its parts said together
    (``TemplateRun``) rather than as bodies."""
    sizes = [parts, *preorder(parts - 1, width)[1]]
    executors = [f"ex{k}" for k in range(parts)]
    controls = [f"tcp://10.0.1.{k % 250}:{7000 + k}" for k in range(parts)]
    if together:
        e = _enqueue(0)
        run = TemplateRun(proxy=e.proxy, names=e.names, scheduler=e.scheduler, epoch=e.epoch, template=e.template,
                          seq=9000, counts=packed([16] * parts), nodes=packed(list(range(16)) * parts),
                          executor_seqs=packed(range(1234, 1234 + parts)))
        return FanOut(run_id="run-00042#3", parent="tcp://10.0.0.2:6000", bodies=[], executors=executors,
                      controls=controls, sizes=sizes, run=run)
    return FanOut(run_id="run-00042#3", parent="tcp://10.0.0.2:6000", bodies=[],
                  parts=[_enqueue(k) for k in range(parts)], executors=executors, controls=controls, sizes=sizes)


def _time(fn: object, rounds: int) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()  # type: ignore[operator]
        samples.append((time.perf_counter() - start) / rounds)
    return statistics.median(samples)


def measure(parts: int, rounds: int = 200, together: bool = False) -> dict[str, float]:
    """Seconds a head spends on one ``FanOut`` of ``parts`` (now and before), and the parts it sends on."""
    frames = encode(subtree_fanout(parts, together=together), msg_id=1)
    relay = FanOutRelay("ex0", capacity=4)

    def now() -> None:
        msg = decode(frames).message
        assert isinstance(msg, FanOut)
        _, sends = relay.fan_out(msg)
        for _, out in sends:
            encode(out, msg_id=2)

    def before() -> None:  # what the head did when the parts travelled decoded (one decode, one encode each)
        msg = decode(frames).message
        assert isinstance(msg, FanOut)
        decoded = [Enqueue.from_wire(_unpack(b)) for b in msg.bodies] if msg.run is None else \
            [run.first(msg.run_id, "") for run in msg.run.cut([(i, i + 1) for i in range(len(msg.executors))])]
        for part in decoded[1:]:
            encode(part, msg_id=2)

    msg = decode(frames).message
    assert isinstance(msg, FanOut)
    _, sends = relay.fan_out(msg)
    return {"parts": parts, "sends": len(sends), "bytes": sum(len(f) for f in frames),
            "now": _time(now, rounds), "before": _time(before, rounds)}


def _unpack(data: bytes) -> object:
    import msgpack  # noqa: PLC0415

    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def report_cost(rounds: int = 2000) -> float:
    """A report the head takes in and one it sends up: a decode and an encode of a small message."""
    frames = encode(RunPartDone(run_id="run-00042#3", executor_id="ex17", device_seconds=1e-4), msg_id=3)
    return _time(lambda: encode(decode(frames).message, msg_id=4), rounds)


def main() -> None:
    for together in (True, False):
        print("a warm template run's parts said together (TemplateRun):" if together else "parts as bodies:")
        fit([measure(n, together=together) for n in (1, 4, 16, 64)])
    print(f"a report in and one up: {report_cost() * 1e6:.1f} us")


def fit(rows: list[dict[str, float]]) -> None:
    for r in rows:
        print(f"FanOut of {r['parts']:>3} parts ({r['bytes']:>6} B, {r['sends']:>2} sends on): "
              f"now {r['now'] * 1e6:7.1f} us, each part decoded and encoded {r['before'] * 1e6:7.1f} us")
    # Least squares: now = a * messages handled whole (the FanOut in, each one out) + b * bodies (in and out).
    xs = [(1 + r["sends"], 2 * r["parts"] - 1) for r in rows]
    ys = [r["now"] for r in rows]
    saa = sum(x[0] * x[0] for x in xs)
    sbb = sum(x[1] * x[1] for x in xs)
    sab = sum(x[0] * x[1] for x in xs)
    say = sum(x[0] * y for x, y in zip(xs, ys, strict=True))
    sby = sum(x[1] * y for x, y in zip(xs, ys, strict=True))
    det = saa * sbb - sab * sab
    a, b = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
    print(f"fit: {a * 1e6:.2f} us per message handled whole + {b * 1e6:.2f} us per part carried")


if __name__ == "__main__":
    main()
