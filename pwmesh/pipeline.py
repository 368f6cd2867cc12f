"""Pipeline-parallel training: a model given as stages, trained as one ``@pw.program`` per step.

    import pwmesh as pw
    stages = [pw.pipeline.Stage(init0, embed_and_blocks), pw.pipeline.Stage(init1, blocks_and_loss)]
    devs = pw.make_virtual_device_set()
    slices = [devs.add_slice(devices=1, island=0), devs.add_slice(devices=1, island=1)]
    pipe = pw.pipeline.Pipeline(stages, slices, optax.adamw(1e-3), microbatches=8)
    state = pipe.init(jax.random.key(0))
    for batch in data:
        state, loss = pipe.step(state, batch)       # returns at once: futures

A model is a list of ``Stage``s, each an ``init(key) -> params`` and an ``apply`` over
its own pytree of parameters. The first stage's ``apply(params, microbatch)`` takes the
microbatch (a pytree of arrays, e.g. tokens), a middle stage's ``apply(params, x)`` the
previous stage's output (any pytree of arrays), and the last stage's
``apply(params, x, microbatch)`` returns the microbatch's scalar loss (its mean over the
microbatch). A single stage is both: ``apply(params, microbatch, microbatch)``.

Each stage lives on the slice given for it (any island; several devices make it data-
or model-parallel there, with ``param_specs`` and ``batch_spec`` over that slice's
mesh). A step splits the batch into ``microbatches`` equal parts and runs one
``@pw.program``: every stage's forward for every microbatch, then the backwards, in the
order the schedule gives each stage (``"gpipe"``: all forwards, then all backwards;
``"1f1b"``: after a warm-up, one forward then one backward, so fewer activations wait);
the last stage runs its forward and backward as one call. Each stage accumulates its
gradients on its own devices and then applies the optimizer (optax) to its own
parameters. Parameters, optimizer state and gradient accumulators never leave their
stage's devices (they are donated from step to step); activations and their gradients
move stage to stage, executor to executor, over the data plane. The step's loss is the
mean over the microbatches: the whole batch's mean, as unpipelined.

The backward recomputes its stage's forward from the stage's input (re-materialisation,
as in GPipe): only each stage's inputs wait between the forward and the backward pass.

The optimizer runs per stage, on that stage's parameters: element-wise optimizers (SGD,
Adam, AdamW, ...) give exactly what they give on the whole model; one that couples
parameters across the model (``optax.clip_by_global_norm``) sees one stage's gradients.

``unpipelined(stages, optimizer)`` is the same model's training step in plain JAX, one
process, no microbatches: the reference the pipeline must equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from pwmesh.client.api import put
from pwmesh.client.array import Array
from pwmesh.client.devices import Slice
from pwmesh.client.functions import JitFunction, jit
from pwmesh.client.program import Program
from pwmesh.client.sharding import resolve
from pwmesh.errors import InvalidArgument

SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a pipelined model (see the module docstring for what ``apply`` takes)."""

    init: Callable[[jax.Array], Any]  # a PRNG key -> this stage's parameters (a pytree of arrays)
    apply: Callable[..., Any]
    param_specs: Any = None  # a PartitionSpec or a pytree prefix of the parameters; None: replicated
    name: str = ""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PipelineState:
    """Per stage: its parameters, its optimizer state, and its gradient accumulator (zero between
    steps; ``{"grads": ..., "loss": ...}``). Every leaf is a ``pw.Array`` on that stage's slice."""

    params: list[Any]
    opt_state: list[Any]
    accumulators: list[Any]


@dataclasses.dataclass(frozen=True)
class Op:
    """One call of the schedule: ``"F"`` forward, ``"B"`` backward (the last stage's forward and
    backward together), ``"U"`` the optimizer's update; of ``stage``, for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int = -1


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[Op]:
    """The calls one stage's devices run in a step, in order."""
    s, m = stage, microbatches
    if stage == stages - 1:
        ops = [Op("B", s, i) for i in range(m)]
    elif schedule == "gpipe":
        ops = [Op("F", s, i) for i in range(m)] + [Op("B", s, i) for i in range(m)]
    elif schedule == "1f1b":
        warm = min(stages - 1 - s, m)
        ops = [Op("F", s, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [Op("F", s, warm + i), Op("B", s, i)]
        ops += [Op("B", s, i) for i in range(m - warm, m)]
    else:
        raise InvalidArgument(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return ops + [Op("U", s)]


def _needs(op: Op, stages: int, microbatches: int) -> list[Op]:
    """The calls of other stages ``op`` reads the results of."""
    s, i = op.stage, op.microbatch
    if op.kind == "F":
        return [Op("F", s - 1, i)] if s > 0 else []
    if op.kind == "B":
        need = [Op("F", s - 1, i)] if s > 0 else []
        return need + ([Op("B", s + 1, i)] if s < stages - 1 else [])
    return []


def global_order(schedule: str, stages: int, microbatches: int) -> list[Op]:
    """Every stage's calls merged into one order that respects the dataflow (the program's node order;
    each device still runs its own calls in its stage's order)."""
    queues = [stage_order(schedule, stages, microbatches, s) for s in range(stages)]
    done: set[Op] = set()
    out: list[Op] = []
    while any(queues):
        progressed = False
        for queue in queues:
            if queue and all(n in done for n in _needs(queue[0], stages, microbatches)):
                op = queue.pop(0)
                done.add(op)
                out.append(op)
                progressed = True
        if not progressed:  # a schedule whose stages wait on each other: a bug here, never the user's
            raise AssertionError(f"schedule {schedule} deadlocks at {[q[0] for q in queues if q]}")
    return out


def _full_specs(specs: Any, tree: Any, what: str) -> Any:
    """``specs`` (a spec or a pytree prefix) as one spec per leaf of ``tree`` (``None`` -> replicated)."""
    flat = resolve(specs, tree, what)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), [s or P() for s in flat])


def _opt_specs(optimizer: optax.GradientTransformation, params: Any, specs: Any) -> Any:
    """The optimizer state's specs: a parameter's moments take its spec; counts and the like are replicated."""
    state = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, spec: spec, state, specs, transform_non_params=lambda _: P(),
                                 is_leaf=lambda x: isinstance(x, P))


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn


@dataclasses.dataclass
class _StageFunctions:
    forward: JitFunction | None
    backward: JitFunction
    update: JitFunction


class Pipeline:
    """A model's stages on slices, trained with ``microbatches`` per step (see the module docstring)."""

    def __init__(self, stages: Sequence[Stage], slices: Sequence[Slice], optimizer: optax.GradientTransformation, *,
                 microbatches: int = 1, schedule: str = "gpipe", batch_spec: Any = None) -> None:
        if not stages:
            raise InvalidArgument("a pipeline needs at least one stage")
        if len(slices) != len(stages):
            raise InvalidArgument(f"{len(stages)} stages need {len(stages)} slices, got {len(slices)}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise InvalidArgument(f"microbatches must be a positive integer, got {microbatches!r}")
        if schedule not in SCHEDULES:
            raise InvalidArgument(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if len({sl.session.session_id for sl in slices}) != 1:
            raise InvalidArgument("a pipeline's slices must belong to one client")
        self.stages = list(stages)
        self.slices = list(slices)
        self.optimizer = optimizer
        self.microbatches = microbatches
        self.schedule = schedule
        self.batch_spec = batch_spec
        self.order = global_order(schedule, len(stages), microbatches)
        self._functions: list[_StageFunctions] | None = None
        self._specs: list[tuple[Any, Any, Any]] | None = None  # per stage: params, opt state, accumulator specs
        self._program = Program(self._step_body)

    def __repr__(self) -> str:
        return (f"pw.pipeline.Pipeline({len(self.stages)} stages on slices "
                f"{[sl.slice_id for sl in self.slices]}, {self.microbatches} microbatches, {self.schedule})")

    # ------------------------------------------------------------ state

    def init(self, key: jax.Array) -> PipelineState:
        """Initialise every stage from its own split of ``key`` (on this host), and place it on its slice."""
        keys = jax.random.split(key, len(self.stages))
        return self.place([jax.device_get(stage.init(k)) for stage, k in zip(self.stages, keys, strict=True)])

    def place(self, params: Sequence[Any], opt_state: Sequence[Any] | None = None) -> PipelineState:
        """State from host values: each stage's ``params`` (and optimizer state, else a fresh one) put on its slice."""
        if len(params) != len(self.stages):
            raise InvalidArgument(f"{len(self.stages)} stages need {len(self.stages)} parameter trees, got "
                                  f"{len(params)}")
        if opt_state is None:
            opt_state = [jax.device_get(self.optimizer.init(p)) for p in params]
        self._prepare(params)
        assert self._specs is not None
        placed_p, placed_o, placed_a = [], [], []
        for s, (sl, p, o, (pspec, ospec, aspec)) in enumerate(zip(self.slices, params, opt_state, self._specs,
                                                                  strict=True)):
            zeros = {"grads": jax.tree_util.tree_map(lambda a: np.zeros(np.shape(a), np.result_type(a)), p),
                     "loss": np.float32(0.0)}
            what = f"stage {s}"
            placed_p.append(self._put(p, sl, pspec, f"{what} parameters"))
            placed_o.append(self._put(o, sl, ospec, f"{what} optimizer state"))
            placed_a.append(self._put(zeros, sl, aspec, f"{what} accumulators"))
        return PipelineState(placed_p, placed_o, placed_a)

    @staticmethod
    def _put(tree: Any, sl: Slice, specs: Any, what: str) -> Any:
        try:
            return put(tree, devices=sl, spec=specs)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{what}: {exc}") from None

    def _prepare(self, params: Sequence[Any]) -> None:
        """Specs and compiled functions, from the parameters' structure (once)."""
        specs = []
        for s, (stage, p) in enumerate(zip(self.stages, params, strict=True)):
            pspec = _full_specs(stage.param_specs, p, f"stage {s} param_specs")
            specs.append((pspec, _opt_specs(self.optimizer, p, pspec), {"grads": pspec, "loss": P()}))
        if self._specs is not None:
            structure = jax.tree_util.tree_structure
            # jaxlib's stubs leave PyTreeDef unresolved for mypy ("PyTreeDef?"), though it compares with ==.
            same = all(structure(a[0]) == structure(b[0])  # type: ignore[operator]
                       for a, b in zip(specs, self._specs, strict=True))
            if not same:
                raise InvalidArgument("these parameters are structured unlike the ones this pipeline was placed with")
            return
        self._specs = specs
        self._functions = [self._stage_functions(s, *spec) for s, spec in enumerate(specs)]

    def _stage_functions(self, s: int, pspec: Any, ospec: Any, aspec: Any) -> _StageFunctions:
        stage, sl, last = self.stages[s], self.slices[s], s == len(self.stages) - 1
        name = stage.name or f"stage{s}"
        scale = 1.0 / self.microbatches
        optimizer = self.optimizer
        first = s == 0
        x_spec = self.batch_spec if first else None  # a stage's input: the microbatch, or what came before

        def accumulate(acc: Any, grads: Any, loss: Any) -> Any:
            return {"grads": jax.tree_util.tree_map(jnp.add, acc["grads"], grads), "loss": acc["loss"] + loss}

        # The last stage differentiates loss / microbatches: the whole batch's mean, summed over the
        # microbatches; the gradients it sends back carry that scale to every stage before it.
        if last:
            def last_backward(p: Any, x: Any, batch: Any, acc: Any) -> Any:
                if first:  # one stage: its input is the microbatch itself, nothing to send back
                    loss, gp = jax.value_and_grad(lambda p: stage.apply(p, x, batch) * scale)(p)
                    return accumulate(acc, gp, loss)
                loss, (gp, gx) = jax.value_and_grad(lambda p, x: stage.apply(p, x, batch) * scale,
                                                    argnums=(0, 1))(p, x)
                return accumulate(acc, gp, loss), gx

            backward = jit(_named(last_backward, f"{name}.backward"), devices=sl,
                           in_specs=(pspec, x_spec, self.batch_spec, aspec), donate_argnums=3)
        else:
            def mid_backward(p: Any, x: Any, gy: Any, acc: Any) -> Any:
                if first:  # its input is the microbatch: no gradient to send back
                    _, pull = jax.vjp(lambda p: stage.apply(p, x), p)
                    (gp,) = pull(gy)
                    return accumulate(acc, gp, jnp.float32(0.0))
                _, pull = jax.vjp(stage.apply, p, x)
                gp, gx = pull(gy)
                return accumulate(acc, gp, jnp.float32(0.0)), gx

            backward = jit(_named(mid_backward, f"{name}.backward"), devices=sl,
                           in_specs=(pspec, x_spec, None, aspec), donate_argnums=3)

        forward = None if last else jit(_named(lambda p, x: stage.apply(p, x), f"{name}.forward"), devices=sl,
                                        in_specs=(pspec, x_spec))

        def update(p: Any, opt: Any, acc: Any) -> Any:
            updates, opt = optimizer.update(acc["grads"], opt, p)
            zeros = jax.tree_util.tree_map(jnp.zeros_like, acc)
            out = (optax.apply_updates(p, updates), opt, zeros)
            return (*out, acc["loss"]) if last else out

        out_specs = (pspec, ospec, aspec, P()) if last else (pspec, ospec, aspec)
        update_fn = jit(_named(update, f"{name}.update"), devices=sl, in_specs=(pspec, ospec, aspec),
                        out_specs=out_specs, donate_argnums=(0, 1, 2))
        return _StageFunctions(forward, backward, update_fn)

    # ------------------------------------------------------------ a step

    def microbatched(self, batch: Any) -> list[Any]:
        """``batch`` (a pytree of host arrays, the batch along axis 0) cut into the step's microbatches."""
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if not leaves:
            raise InvalidArgument("the batch has no arrays")
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Array):
                raise InvalidArgument(f"batch leaf {i} is a pw.Array; a pipeline takes the batch from the host")
        arrays = [np.asarray(leaf) for leaf in leaves]
        sizes = {a.shape[0] for a in arrays if a.ndim}
        if len(sizes) != 1 or any(not a.ndim for a in arrays):
            raise InvalidArgument(f"every batch leaf must have the batch along axis 0; got shapes "
                                  f"{[a.shape for a in arrays]}")
        (size,) = sizes
        m = self.microbatches
        if size % m:
            raise InvalidArgument(f"a batch of {size} does not split into {m} equal microbatches")
        k = size // m
        return [jax.tree_util.tree_unflatten(tree, [a[i * k:(i + 1) * k] for a in arrays]) for i in range(m)]

    def step(self, state: PipelineState, batch: Any) -> tuple[PipelineState, Array]:
        """One training step (one program, dispatched without waiting): the new state and the step's loss.
        ``state`` is consumed (its buffers are donated), as with ``jax.jit(..., donate_argnums=...)``."""
        if self._functions is None:
            raise InvalidArgument("place the pipeline's state first (pipe.init or pipe.place)")
        return self._program(state, self.microbatched(batch))

    def _step_body(self, state: PipelineState, microbatches: list[Any]) -> tuple[PipelineState, Any]:
        assert self._functions is not None
        fns = self._functions
        last = len(self.stages) - 1
        params, opt, acc = list(state.params), list(state.opt_state), list(state.accumulators)
        inputs: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> what the stage reads
        grads_in: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> the gradient of its output
        loss = None
        for op in self.order:
            s, i = op.stage, op.microbatch
            x = microbatches[i] if s == 0 else inputs.get((s, i))
            if op.kind == "F":
                forward = fns[s].forward
                assert forward is not None  # the last stage's forward is in its backward: it has no F
                inputs[(s + 1, i)] = forward(params[s], x)
            elif op.kind == "B":  # the last stage reads the microbatch (targets), the others their gradient
                out = fns[s].backward(params[s], x, microbatches[i] if s == last else grads_in.pop((s, i)), acc[s])
                acc[s], grads_in[(s - 1, i)] = out if s > 0 else (out, None)
            else:
                params[s], opt[s], acc[s], *rest = fns[s].update(params[s], opt[s], acc[s])
                loss = rest[0] if s == last else loss
        return PipelineState(params, opt, acc), loss


def unpipelined(stages: Sequence[Stage], optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """The same model's training step in plain JAX, whole batch, no pipeline: ``step(params, opt_state, batch)
    -> (params, opt_state, loss)`` with ``params`` the list of stages' parameters and ``opt_state`` the
    optimizer's state of that list (``optimizer.init(params)``). For the caller to ``jax.jit``."""
    stages = list(stages)

    def loss_fn(params: list[Any], batch: Any) -> Any:
        if len(stages) == 1:
            return stages[0].apply(params[0], batch, batch)
        x = stages[0].apply(params[0], batch)
        for stage, p in zip(stages[1:-1], params[1:-1], strict=True):
            x = stage.apply(p, x)
        return stages[-1].apply(params[-1], x, batch)

    def step(params: list[Any], opt_state: Any, batch: Any) -> tuple[list[Any], Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


__all__ = ["SCHEDULES", "Op", "Pipeline", "PipelineState", "Stage", "global_order", "stage_order", "unpipelined"]
