"""The benchmark's steps: donation pairs each buffer with its own output; a tiny run works."""

import json
import re

import jax
import pytest

from optirs_jax import bench


@pytest.mark.parametrize("impl", bench.JAX_IMPLS)
def test_each_donated_buffer_is_paired_with_its_own_output(impl):
  # JAX pairs a donated input with the first unclaimed output of its shape; a step whose
  # arguments come in another order than its outputs makes XLA copy every state buffer.
  shapes = {"a": (8, 128), "b": (8, 128), "c": (256,)}
  tx, step = bench.jax_step(impl, bench.OPTIMIZERS["adam"])
  params, grads = bench.make_tree(shapes, 0), bench.make_tree(shapes, 1)
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes int count and floats
    text = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).as_text()
  signature = next(line for line in text.splitlines() if "func.func public @main" in line)
  args = re.findall(r"%arg(\d+): tensor<[^>]*>( \{[^}]*\})?", signature)
  n_donated = len(jax.tree.leaves((params, state)))
  aliases = [re.search(r"tf.aliasing_output = (\d+)", attrs) for _, attrs in args]
  assert [int(m.group(1)) if m else None for m in aliases] == (
      list(range(n_donated)) + [None] * (len(args) - n_donated))


def test_a_tiny_run_reports_every_job(tmp_path):
  out = tmp_path / "bench.json"
  assert bench.main(["--trees", "flat,leaves-flat", "--optimizers", "sgd", "--scale", "0.001",
                     "--steps", "1", "--batches", "1", "--warmup", "1", "--no-torch",
                     "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  jobs = {(r["tree"], r["impl"]) for r in report["results"]}
  assert jobs == {(t, i) for t in ("flat", "leaves-flat")
                  for i in ("optirs-apply", "optirs-update", "optax")}
  for r in report["results"]:
    assert r["ms"] > 0 and r["speedup_vs_optax"] > 0, r


def test_an_unknown_tree_names_the_valid_ones():
  with pytest.raises(ValueError, match="leaves-flat"):
    bench.tree_shapes("gpt3", 1.0)


def test_loop_steps_and_policies_are_timed_and_recorded(tmp_path, standard_promotion):
  out = tmp_path / "bench.json"
  assert bench.main(["--trees", "leaves-flat", "--optimizers", "adam", "--scale", "0.001",
                     "--steps", "2", "--batches", "1", "--warmup", "1", "--no-torch",
                     "--impls", "optirs-apply,optax", "--loop-steps", "3",
                     "--small-leaves", "pack", "--large-leaves", "in-place",
                     "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert (report["meta"]["small_leaf_policy"], report["meta"]["large_leaf_policy"]) == (
      "pack", "in-place")
  for r in report["results"]:
    assert 0 < r["host_ms"] <= r["ms"] * 1.01 and r["loop_ms"] > 0, r
    assert r["loop_pct_copy"] > 0 and r["loop_speedup_vs_optax"] > 0, r
