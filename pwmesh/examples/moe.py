"""Mixture-of-experts routing: each token goes to one expert, on its own slice.

A router (``pw.jit`` on a home slice of two devices) scores every token and picks
an expert; ``pw.Router`` sends each token's row only to its expert's executor
(experts are spread over executors and islands), runs the experts, and brings
their rows back in token order on the home slice. Experts that get no tokens
still complete. The result is checked against the same layer in plain JAX in
this process. Run it with ``pwmesh submit pwmesh/examples/moe.py`` (an embedded
cluster without ``--address``) or ``python -m pwmesh.examples.moe``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pwmesh as pw

TOKENS, DIM, EXPERTS = 64, 16, 4


def weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((DIM, EXPERTS)).astype(np.float32)
    experts = (rng.standard_normal((EXPERTS, DIM, DIM)) / np.sqrt(DIM)).astype(np.float32)
    return router, experts


def route(x: jax.Array, w_router: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Each token's expert: the best-scoring one."""
    return x, jnp.argmax(x @ w_router, axis=-1).astype(jnp.int32)


def expert(w: np.ndarray):  # noqa: ANN201 - a function factory
    def ffn(h: jax.Array) -> jax.Array:  # row by row: tokens are independent
        return jax.nn.gelu(h @ w) + h
    return ffn


def reference(x: np.ndarray, w_router: np.ndarray, w_experts: np.ndarray) -> np.ndarray:
    """The same layer in plain JAX, one process: every token through its own expert."""
    _, ids = route(jnp.asarray(x), w_router)
    outs = jnp.stack([expert(w)(jnp.asarray(x)) for w in w_experts])  # [experts, tokens, dim]
    return np.asarray(outs[ids, jnp.arange(len(x))])


def main(seed: int = 0) -> np.ndarray:
    w_router, w_experts = weights(seed)
    devs = pw.make_virtual_device_set()
    home = devs.add_slice(devices=2)
    slices = [devs.add_slice(devices=1) for _ in range(EXPERTS)]
    router = pw.jit(lambda x: route(x, w_router), devices=home)
    layer = pw.Router([pw.jit(expert(w), devices=s) for w, s in zip(w_experts, slices, strict=True)], devices=home)

    @pw.program
    def moe(x):
        h, ids = router(x)
        return layer(h, ids), ids

    x = np.random.default_rng(seed + 1).standard_normal((TOKENS, DIM)).astype(np.float32)
    y, ids = moe(x)
    y_value, ids_value = pw.get((y, ids))
    for k, s in enumerate(slices):
        d = s.devices[0]
        print(f"expert {k}: {int(np.sum(ids_value == k)):3d} tokens on {d.executor}:cpu{d.device} "
              f"(island {s.island})")
    np.testing.assert_allclose(y_value, reference(x, w_router, w_experts), rtol=1e-5, atol=1e-5)
    print(f"{TOKENS} tokens routed to {EXPERTS} experts and combined in order: equal to plain JAX")
    return y_value


if __name__ == "__main__":
    main()
