"""JAX's own sharded MLP tutorial, once with plain JAX and once on pwmesh, side by side.

The model nobody here wrote: section "Examples: neural networks" of JAX's tutorial "Distributed
arrays and automatic parallelization"
(https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html;
source jax-ml/jax, docs/notebooks/Distributed_arrays_and_automatic_parallelization.md at commit
4ffc56e610bc6a274777aea83a95819204493971, run here with jax 0.10.2). A four-layer ReLU MLP on
random data, written for ``jax.jit`` and computation-follows-data: ``jax.device_put`` with
``NamedSharding``s, then ``jax.jit(loss)`` and ``jax.jit(jax.grad(loss))`` with no shardings of their
own, and plain SGD applied eagerly, outside any jit. It trains twice: 8-way data parallelism on a
mesh ``(8,) ('batch',)``, then 4-way data and 2-way tensor parallelism on ``(4, 2) ('batch',
'model')`` (Megatron-style: the second layer's columns, the third's rows).

The tutorial's code is restated here in its own order and names, not copied: the model functions
below as they are, ``with_jax`` its two training sections, ``with_pwmesh`` the same lines with the
fewest edits pwmesh needs, each marked ``# pwmesh:`` (the meshes; ``jax.jit``, ``jax.device_put`` and
``NamedSharding`` from ``pw`` instead of ``jax``). Both record the loss before training and
after every step (not in the tutorial: it prints the loss before and after) and take the sizes as
arguments (the tutorial's defaults are below; the test uses smaller ones).

    python -m pwmesh.examples.jax_tutorial --system jax --steps 20      # 8 CPU devices in this process
    python -m pwmesh.examples.jax_tutorial --system pwmesh --steps 20   # $PWMESH_ADDRESS, else an embedded
                                                                       # island of 2 hosts x 4 devices

(the tutorial's sizes take minutes a step on a CPU: ``--layer-sizes 784,128,128,128,10 --batch-size 256``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pwmesh as pw

LAYER_SIZES = (784, 8192, 8192, 8192, 10)  # the tutorial's
BATCH_SIZE = 8192
STEPS = 30

# AUTO: the tutorial was written when ``jax.make_mesh`` made axes of type Auto (the compiler picks
# intermediate shardings); since jax 0.7 it makes them Explicit, under which its tensor-parallel
# section fails (``jnp.dot`` over the 'model'-sharded contracting dimension asks for an
# ``out_sharding``). The plain-JAX form asks for Auto, as it meant; pwmesh traces under Auto axes.
Auto = AxisType.Auto


# The tutorial's model, unchanged: plain JAX, used by both forms.

def predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jnp.maximum(outputs, 0)
    return outputs


def loss(params, batch):
    inputs, targets = batch
    predictions = predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def init_model(key, layer_sizes, batch_size):
    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

    return params, (inputs, targets)


step_size = 1e-5




def with_jax(layer_sizes=LAYER_SIZES, batch_size=BATCH_SIZE, steps=STEPS) -> dict[str, list[float]]:
    """The tutorial with plain JAX (8 devices). The losses of each section, before and after each step."""
    losses: dict[str, list[float]] = {"data": [], "data_and_model": []}
    loss_jit = jax.jit(loss)
    gradfun = jax.jit(jax.grad(loss))

    params, batch = init_model(jax.random.key(0), layer_sizes, batch_size)

    # 8-way batch data parallelism
    mesh = jax.make_mesh((8,), ('batch',), axis_types=(Auto,))  # see AUTO

    sharding = NamedSharding(mesh, P('batch'))
    replicated_sharding = NamedSharding(mesh, P())
    batch = jax.device_put(batch, sharding)
    params = jax.device_put(params, replicated_sharding)
    losses["data"].append(float(np.asarray(loss_jit(params, batch))))

    for _ in range(steps):
        grads = gradfun(params, batch)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]  # noqa: B905 - as the tutorial
        losses["data"].append(float(np.asarray(loss_jit(params, batch))))

    # 4-way batch data parallelism and 2-way model tensor parallelism
    mesh = jax.make_mesh((4, 2), ('batch', 'model'), axis_types=(Auto, Auto))  # see AUTO

    batch = jax.device_put(batch, NamedSharding(mesh, P('batch', None)))
    replicated_sharding = NamedSharding(mesh, P())
    (W1, b1), (W2, b2), (W3, b3), (W4, b4) = params

    W1 = jax.device_put(W1, replicated_sharding)
    b1 = jax.device_put(b1, replicated_sharding)

    W2 = jax.device_put(W2, NamedSharding(mesh, P(None, 'model')))
    b2 = jax.device_put(b2, NamedSharding(mesh, P('model')))

    W3 = jax.device_put(W3, NamedSharding(mesh, P('model', None)))
    b3 = jax.device_put(b3, replicated_sharding)

    W4 = jax.device_put(W4, replicated_sharding)
    b4 = jax.device_put(b4, replicated_sharding)

    params = (W1, b1), (W2, b2), (W3, b3), (W4, b4)
    losses["data_and_model"].append(float(np.asarray(loss_jit(params, batch))))

    for _ in range(steps):
        grads = gradfun(params, batch)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]  # noqa: B905 - as the tutorial
        losses["data_and_model"].append(float(np.asarray(loss_jit(params, batch))))
    return losses


def with_pwmesh(layer_sizes=LAYER_SIZES, batch_size=BATCH_SIZE, steps=STEPS) -> dict[str, list[float]]:
    """The same on pwmesh (the default client's cluster: two slices of 8 devices of one island). The edits:
    the meshes are slices of the cluster; ``jax.jit``, ``jax.device_put`` and ``NamedSharding`` are pw's."""
    losses: dict[str, list[float]] = {"data": [], "data_and_model": []}
    loss_jit = pw.jit(loss)  # pwmesh: jax.jit (it runs where its arguments are, as jax.jit's does)
    gradfun = pw.jit(jax.grad(loss))  # pwmesh: jax.jit

    params, batch = init_model(jax.random.key(0), layer_sizes, batch_size)

    # 8-way batch data parallelism
    mesh = pw.make_virtual_device_set().add_slice(devices=8, mesh={'batch': 8})  # pwmesh: the mesh

    sharding = pw.NamedSharding(mesh, P('batch'))  # pwmesh: NamedSharding
    replicated_sharding = pw.NamedSharding(mesh, P())  # pwmesh: NamedSharding
    batch = pw.device_put(batch, sharding)  # pwmesh: jax.device_put
    params = pw.device_put(params, replicated_sharding)  # pwmesh: jax.device_put
    losses["data"].append(float(np.asarray(loss_jit(params, batch))))

    for _ in range(steps):
        grads = gradfun(params, batch)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]  # noqa: B905 - as the tutorial
        losses["data"].append(float(np.asarray(loss_jit(params, batch))))

    # 4-way batch data parallelism and 2-way model tensor parallelism
    mesh = pw.make_virtual_device_set().add_slice(devices=8, mesh={'batch': 4, 'model': 2})  # pwmesh: the mesh

    batch = pw.device_put(batch, pw.NamedSharding(mesh, P('batch', None)))  # pwmesh: (the same two names below)
    replicated_sharding = pw.NamedSharding(mesh, P())
    (W1, b1), (W2, b2), (W3, b3), (W4, b4) = params

    W1 = pw.device_put(W1, replicated_sharding)
    b1 = pw.device_put(b1, replicated_sharding)

    W2 = pw.device_put(W2, pw.NamedSharding(mesh, P(None, 'model')))
    b2 = pw.device_put(b2, pw.NamedSharding(mesh, P('model')))

    W3 = pw.device_put(W3, pw.NamedSharding(mesh, P('model', None)))
    b3 = pw.device_put(b3, replicated_sharding)

    W4 = pw.device_put(W4, replicated_sharding)
    b4 = pw.device_put(b4, replicated_sharding)

    params = (W1, b1), (W2, b2), (W3, b3), (W4, b4)
    losses["data_and_model"].append(float(np.asarray(loss_jit(params, batch))))

    for _ in range(steps):
        grads = gradfun(params, batch)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]  # noqa: B905 - as the tutorial
        losses["data_and_model"].append(float(np.asarray(loss_jit(params, batch))))
    return losses


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("jax", "pwmesh"), default="pwmesh")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layer-sizes", default=",".join(map(str, LAYER_SIZES)))
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--json", metavar="PATH", help="write the losses there")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.layer_sizes.split(",")]
    if args.system == "jax":
        jax.config.update("jax_num_cpu_devices", 8)  # as the tutorial's page does: 8 CPU devices
        losses = with_jax(sizes, args.batch_size, args.steps)
    elif os.environ.get("PWMESH_ADDRESS"):
        pw.connect()
        losses = with_pwmesh(sizes, args.batch_size, args.steps)
    else:  # the embedded cluster, with an island of 8 devices (the default one has 4 an island)
        pw.connect(cluster=pw.LocalClusterSpec(islands=1, hosts_per_island=2, devices_per_host=4, collectives=True))
        losses = with_pwmesh(sizes, args.batch_size, args.steps)
    for section, values in losses.items():
        print(f"{section}: loss {values[0]:.6f} -> {values[-1]:.6f} after {len(values) - 1} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system": args.system, "losses": losses}, f)
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
