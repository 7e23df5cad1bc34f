"""Per-platform branches, each traced only when a step is lowered for its platform.

``jax.lax.platform_dependent`` traces every branch when the step is traced, and lowering
keeps the one of the platform compiled for. A step that can run on a GPU therefore also
traced the jnp reference its CPU branch holds, though a GPU compile never uses it (2000
leaves of Adam for an H200, on a 2-core CPU: trace 1.7-1.9 s with it, 0.8 s without;
lowering 1.2 s with it, 0.9 s without: ``benchmarks/results/2026-12-05-cpu-lazy-branches.txt``).

:func:`platform_dependent` traces the *first* branch it is given (the platform the step
is most likely compiled for) when the step is traced, and binds one primitive holding
that jaxpr. Its lowering for that platform lowers the jaxpr; lowered for another platform
alone, it traces that platform's branch (or ``default``) then, from the operands' types.
Lowered for several platforms at once (``jax.export(..., platforms=[...])``), and under
any transformation (``vmap``, ``jvp``, transposition), it is ``jax.lax.platform_dependent``
of the same branches, traced there.

The branches take the operands given (a pytree of arrays) and nothing traced besides: a
branch run at lowering time cannot see the tracers of the trace it was made in.

>>> import jax, jax.numpy as jnp
>>> f = lambda x: platform_dependent(x, cuda=lambda x: x + 1.0, default=lambda x: x * 2.0)
>>> float(jax.jit(f)(jnp.float32(3.0))) == (4.0 if jax.default_backend() == "gpu" else 6.0)
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import dispatch
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching
from jax._src.interpreters import partial_eval as pe
from jax.interpreters import mlir

branch_p = jax_core.Primitive("optirs_platform_branch")
branch_p.multiple_results = True


def platform_dependent(args, *, default: Callable, **branches: Callable):
  """``jax.lax.platform_dependent(args, default=default, **branches)``, the branches of
  platforms other than the first traced only when lowering for them.

  Args:
    args: a pytree of arrays, the branches' one argument.
    default: the branch of every platform not named.
    branches: per platform (``cuda``, ``tpu``, ``cpu``, ...), its branch; the first is
      traced now.

  Returns:
    The branches' result (a pytree of arrays, alike in every branch).
  """
  if not branches:
    raise ValueError("platform_dependent needs at least one named platform's branch")
  flat, in_tree = jax.tree.flatten(args)
  primary = next(iter(branches))
  out_trees = []

  def traced(*xs):  # the primary branch on flat operands, its flat results
    leaves, tree = jax.tree.flatten(branches[primary](jax.tree.unflatten(in_tree, xs)))
    out_trees.append(tree)
    return leaves

  # Traced as jax.make_jaxpr would, without naming each of the (thousands of) operands.
  debug = jax_core.DebugInfo("platform_dependent", primary, None, None)
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(traced, debug_info=debug),
                                               [jax.typeof(x) for x in flat])
  out_tree, = out_trees
  table = tuple(sorted(branches.items()))
  # The constants become leading operands, the jaxpr's leading inputs.
  outs = branch_p.bind(*consts, *flat, jaxpr=pe.convert_constvars_jaxpr(jaxpr),
                       n_consts=len(consts), primary=primary, branches=table,
                       default=default, in_tree=in_tree, out_tree=out_tree)
  return jax.tree.unflatten(out_tree, outs)


def _flat_branch(fn, in_tree, out_tree):
  """``fn`` on flat operands, returning its flat results (checked against ``out_tree``)."""

  def run(*flat):
    result = fn(jax.tree.unflatten(in_tree, flat))
    leaves, tree = jax.tree.flatten(result)
    if tree != out_tree:
      raise TypeError(f"platform branches must return alike; got {tree}, expected {out_tree}")
    return leaves

  return run


def _eager(*, branches, default, in_tree, out_tree, **_):
  """The primitive as ``jax.lax.platform_dependent`` of its branches: a function of its
  operands without the primary jaxpr's constants (``_``: the params it does not need)."""
  run = {p: _flat_branch(fn, in_tree, out_tree) for p, fn in branches}
  flat_default = _flat_branch(default, in_tree, out_tree)
  return lambda *flat: jax.lax.platform_dependent(*flat, default=flat_default, **run)


# Outside ``jit`` (an optimizer's update called eagerly) the primitive is compiled alone, as
# jax's own control flow is: lowered for the platform of its operands, as below.
branch_p.def_impl(functools.partial(dispatch.apply_primitive, branch_p))


@branch_p.def_abstract_eval
def _abstract_eval(*args, jaxpr, **_):
  del args
  return [v.aval for v in jaxpr.outvars]


def _lowering(ctx, *args, jaxpr, n_consts, primary, branches, default, in_tree, out_tree):
  platforms = ctx.module_context.platforms
  if len(platforms) == 1 and platforms[0] == primary:  # the jaxpr traced already, inlined
    outs, tokens = mlir.jaxpr_subcomp(
      ctx.module_context, jaxpr, ctx.name_stack, ctx.tokens_in, [], *args,
      dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
      outer_traceback=ctx.traceback)
    ctx.set_tokens_out(tokens)
    return outs
  if len(platforms) != 1:  # one module for several platforms: switch on the platform
    eager = _eager(branches=branches, default=default, in_tree=in_tree, out_tree=out_tree)
    fn = lambda *a: eager(*a[n_consts:])
  else:
    branch = _flat_branch(dict(branches).get(platforms[0], default), in_tree, out_tree)
    want = [(a.shape, a.dtype) for a in ctx.avals_out]

    def fn(*a):
      outs = branch(*a[n_consts:])
      got = [(jnp.shape(o), jnp.result_type(o)) for o in outs]
      if got != want:
        raise TypeError(f"the {platforms[0]} branch returns {got}; the {primary} branch "
                        f"returned {want}: platform branches must return alike")
      return outs
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(branch_p, _lowering)


def _batching(args, dims, *, n_consts, **params):
  axes = [d if isinstance(d, int) else None for d in dims]  # not_mapped: None or a sentinel
  outs = jax.vmap(_eager(**params), in_axes=axes[n_consts:])(*args[n_consts:])
  return outs, [0] * len(outs)


batching.primitive_batchers[branch_p] = _batching


def _jvp(primals, tangents, *, n_consts, **params):
  tangents = [ad.instantiate_zeros(t) for t in tangents[n_consts:]]
  return jax.jvp(_eager(**params), tuple(primals[n_consts:]), tuple(tangents))


ad.primitive_jvps[branch_p] = _jvp
