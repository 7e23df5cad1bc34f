"""The catalogue's table for the README, from a benchmark JSON of GPT-2 small:

    python -m optirs_jax.bench --trees gpt2 --optimizers <every registry name> \
        --impls optirs-apply,optax --no-torch --json bench.json
    python benchmarks/catalogue_table.py bench.json

One row per optimizer of the registry found in the JSON: the fused apply's kernel time per
step (profiler), its % of the copy bandwidth at the optimizer's minimal bytes, its ratio to
optax's kernel time in the same run, optax's time, and whether it meets the goal (95% of its
bytes for an elementwise rule, 90% for one with per-leaf norms, faster than optax for a
factored one: Adafactor). Rows whose kernel time is missing (a CPU run, a cut run) say so.
"""

from __future__ import annotations

import argparse
import json
import sys

from optirs_jax.transforms import REGISTRY

GOAL = {False: 95.0, True: 90.0}  # % of copy bandwidth: elementwise, per-leaf norms


def rows(report: dict, tree: str = "gpt2") -> list[dict]:
  """Per registry optimizer in ``report``: its fused apply and optax's kernel times."""
  found: dict[str, dict] = {}
  for r in report["results"]:
    if r.get("tree") == tree and r.get("optimizer") in REGISTRY:
      found.setdefault(r["optimizer"], {})[r["impl"]] = r
  out = []
  for name in sorted(found):
    ours, theirs = found[name].get("optirs-apply"), found[name].get("optax")
    norms = REGISTRY[name].norms
    pct = None if ours is None else ours.get("kernel_pct_copy")
    x_optax = None if ours is None else ours.get("kernel_x_optax")
    if REGISTRY[name].spec.factored is not None:  # the goal: faster than optax
      goal, met = "faster than optax", None if x_optax is None else x_optax > 1.0
    else:
      goal, met = f"{GOAL[norms]:.0f}%", None if pct is None else pct >= GOAL[norms]
    out.append({"optimizer": name, "norms": norms,
                "bytes_per_param": (ours or theirs)["bytes_per_param"],
                "ms": None if ours is None else ours.get("kernel_ms"), "pct": pct,
                "x_optax": x_optax,
                "optax_ms": None if theirs is None else theirs.get("kernel_ms"),
                "goal": goal, "met": met})
  return out


def markdown(report: dict, tree: str = "gpt2") -> str:
  m = report["meta"]
  head = [f"{m['device']}, {m['date']}, jax {m['versions']['jax']}, optax "
          f"{m['versions']['optax']}: `{m['command']}`", "",
          "| optimizer | B/param | `optirs_jax.apply` | optax | goal |", "|---|---|---|---|---|"]
  body = []
  for r in rows(report, tree):
    ms = lambda v: "-" if v is None else f"{v:.3f} ms"
    ours = ("no kernel time" if r["ms"] is None else
            f"{r['ms']:.3f} ms ({r['pct']:.1f}%, {r['x_optax']:.2f}x)"
            if r["x_optax"] is not None else f"{r['ms']:.3f} ms ({r['pct']:.1f}%)")
    met = "-" if r["met"] is None else ("met" if r["met"] else "not met")
    body.append(f"| `{r['optimizer']}` | {r['bytes_per_param']} | {ours} | "
                f"{ms(r['optax_ms'])} | {r['goal']}: {met} |")
  return "\n".join(head + body)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("json", help="a benchmark JSON (python -m optirs_jax.bench --json)")
  p.add_argument("--tree", default="gpt2")
  args = p.parse_args(argv)
  with open(args.json) as f:
    report = json.load(f)
  if not rows(report, args.tree):
    print(f"{args.json}: no optimizer of the registry on tree {args.tree!r}", file=sys.stderr)
    return 1
  print(markdown(report, args.tree))
  return 0


if __name__ == "__main__":
  sys.exit(main())
