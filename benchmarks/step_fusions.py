"""What the whole training step's compiled program holds beside the optimizer, for a
compile-only H200 (no GPU needed: jax's CUDA plugin, see optirs_jax.bench.compile_only).

    PYTHONPATH=. python3 benchmarks/step_fusions.py [model] [configs] [batch]

Defaults ``gpt2 optax,optirs-fused 8``: the training benchmark's configurations
(:mod:`optirs_jax.bench.steps`). Per configuration it compiles three programs, the whole
step, the gradients alone and the optimizer alone, and prints each one's fusions and custom
calls (the Pallas kernels), then the step's fusions by (kind, root op) that the gradients'
program does not have, and the loop fusions whose root is a convert that only the step has
(with their operand and result shapes): the work XLA adds around the optimizer inside the
step.
"""

import collections
import re
import sys

import jax
import jax.numpy as jnp

from optirs_jax.bench import compile_only as co
from optirs_jax.bench import gpt, steps


def _computations(text: str) -> dict[str, str]:
  return {m.group(1): m.group(2) for m in re.finditer(
      r"\n(%?[\w.\-]+) \([^\n]*\) -> [^\n]* \{\n(.*?)\n\}", text, re.S)}


def fusions(text: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
  """Each fusion of the entry computation: (kind, root op, result shape, operand shapes)."""
  comps = _computations(text)
  out = []
  for line in text[text.index("ENTRY"):].split("\n"):
    m = re.search(r"= (\S+) fusion\(.*kind=(\w+), calls=(%?[\w.\-]+)", line)
    if m:
      body = comps.get(m.group(3), "")
      root = re.findall(r"ROOT \S+ = \S+ ([a-z][\w\-]*)\(", body)
      out.append((m.group(2), root[0] if root else "?", m.group(1),
                  tuple(re.findall(r"= (\S+) parameter\(", body))))
  return out


def main(argv):
  model, names, batch = (argv[1:] + ["gpt2", "optax,optirs-fused", "8"][len(argv) - 1:])[:3]
  cfg = gpt.GPTConfig.preset(model)
  tokens = jax.ShapeDtypeStruct((int(batch), cfg.context + 1), jnp.int32)
  print(f"# jax {jax.__version__}, compile-only H200; model {model}, batch {batch}")
  for name in names.split(","):
    run = steps.Run(name, cfg, steps.Hyper())
    grads = jax.eval_shape(run._grads, run.state, tokens)
    found = {}
    for what, fn, args in (("step", run._step, (run.state, tokens)),
                           ("grads", run._grads, (run.state, tokens)),
                           ("optimizer", run._opt_step, (run.state, grads))):
      with jax.sharding.use_abstract_mesh(co.h200_meshes()[1]):
        text = fn.lower(*co.on_h200(args)).compile().as_text()
      entry = text[text.index("ENTRY"):]
      found[what] = fusions(text)
      print(f"{name:14s} {what:10s} fusions {len(found[what]):5d}  custom calls "
            f"{len(re.findall(r'custom-call[(]', entry)):3d}")
    step = collections.Counter((k, r) for k, r, _, _ in found["step"])
    alone = collections.Counter((k, r) for k, r, _, _ in found["grads"])
    print(f"  step - gradients, by (kind, root): "
          f"{dict((k, n) for k, n in (step - alone).items())} minus "
          f"{dict((k, n) for k, n in (alone - step).items())}")
    extra = (collections.Counter(f for f in found["step"] if f[:2] == ("kLoop", "convert"))
             - collections.Counter(f for f in found["grads"] if f[:2] == ("kLoop", "convert")))
    for (_, _, result, operands), n in sorted(extra.items(), key=lambda x: x[0][2]):
      print(f"  {n:3d} x convert fusion {', '.join(operands)} -> {result}")


if __name__ == "__main__":
  main(sys.argv)
