"""The paper's Figure 2: three compiled functions on three slices, one program.

Run it with ``pwmesh demo`` (embedded cluster) or ``pwmesh submit`` against a
running cluster. Prints ``[2. 3.] [2. 4.]`` and where each computation ran.
"""

from __future__ import annotations

import numpy as np

import pwmesh as pw


def where(sl: pw.Slice) -> str:
    return ", ".join(f"{d.executor}:cpu{d.device}" for d in sl.devices) + f" (island {sl.island})"


def main() -> tuple[np.ndarray, np.ndarray]:
    devs = pw.make_virtual_device_set()
    s1, s2, s3 = (devs.add_slice(devices=2) for _ in range(3))
    a = pw.pmap(lambda x: x * 2.0, devices=s1.devices)
    b = pw.pmap(lambda x: x + 1.0, devices=s2.devices)
    c = pw.pmap(lambda x: x / 2.0, devices=s3.devices)

    @pw.program
    def f(v):
        x = a(v)
        y = b(v)
        z = a(c(x))
        return (y, z)

    y, z = f(np.array([1.0, 2.0]))
    print("a (x * 2) ran on", where(s1))
    print("b (x + 1) ran on", where(s2))
    print("c (x / 2) ran on", where(s3))
    print("program: 4 nodes, dispatched as one message per island; y, z are futures:", y, z)
    y_value, z_value = pw.get((y, z))
    print(y_value, z_value)
    return y_value, z_value


if __name__ == "__main__":
    main()
