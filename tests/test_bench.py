"""The benchmark's steps: donation pairs each buffer with its own output; device time is read
from a profile; arguments are validated; a tiny run reports every job."""

import json
import re

import jax
import pytest
from jax.profiler import ProfileData

from optirs_jax import bench
from optirs_jax.bench import timing


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


PROFILE = """
planes {
  id: 1
  name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2500000
             stats { metadata_id: 7 str_value: "fusion.3" } }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 500000 } }
  lines { id: 2 name: "Stream #14(memcpy)" timestamp_ns: 1000
    events { metadata_id: 2 offset_ps: 100 duration_ps: 1000000 } }
  lines { id: 3 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "adam" } }
  event_metadata { key: 2 value { id: 2 name: "copy" } }
  stat_metadata { key: 7 value { id: 7 name: "hlo_op" } }
}
"""


def test_device_time_sums_the_stream_lines_of_the_device_plane():
  profile = ProfileData.from_text_proto(PROFILE)
  # 2.5 + 0.5 + 1.0 us on the stream lines; the "XLA Ops" line repeats them, not counted.
  assert timing.device_seconds(profile) == pytest.approx(4.0e-6)
  assert timing.device_seconds(profile, "/device:GPU:1") is None
  # Busy: [0, 2.5] and [3.0, 3.5] us on one stream, [0, 1.0] on the other inside the first.
  assert timing.device_seconds(profile, busy=True) == pytest.approx(3.0e-6)
  # A device plane with no event on its streams (a CPU-only process on a GPU machine, run
  # 49): no device time, not zero.
  idle = ProfileData.from_text_proto(
      'planes { id: 1 name: "/device:GPU:0" lines { id: 1 name: "Stream #13(compute)" } }')
  assert timing.device_seconds(idle) is None and timing.device_seconds(idle, busy=True) is None
  # Per kernel name, longest first: adam 2.5 us once; copy 0.5 + 1.0 us in two events.
  top = timing.top_kernels(profile, 5)
  assert [(n, c) for n, _, c in top] == [("adam", 1), ("copy", 2)]
  assert [s for _, s, _ in top] == pytest.approx([2.5e-6, 1.5e-6])
  # By the HLO op that launched each (named where the event has the stat).
  top = timing.top_kernels(profile, 5, by_op=True)
  assert [(n, c) for n, _, c in top] == [("adam @ fusion.3", 1), ("copy", 2)]


def test_kernel_time_is_read_where_there_is_a_gpu_plane():
  f = jax.jit(lambda x: x + 1, donate_argnums=0)
  seconds, x = timing.kernel_seconds_per_step(f, jax.numpy.zeros(8), 3)
  assert float(x[0]) == 3.0
  if jax.default_backend() == "gpu":
    assert 0 < seconds < 1e-3
  else:
    assert seconds is None  # no device plane on the CPU


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
    assert r["ms"] > 0 and r["x_optax"] > 0 and r["first_call_s"] > 0, r
    assert (r["kernel_ms"] is None) == (jax.default_backend() == "cpu")
  assert report["meta"]["versions"]["optax"] and "command" in report["meta"]


def test_mixed_precision_case_and_loop_steps(tmp_path, standard_promotion):
  out = tmp_path / "bench.json"
  assert bench.main(["--trees", "leaves", "--optimizers", "adamw_bf16_master", "--scale",
                     "0.0001", "--steps", "2", "--batches", "1", "--warmup", "1", "--no-torch",
                     "--loop-steps", "2", "--small-leaves", "pack", "--large-leaves",
                     "in-place", "--json", str(out)]) == 0
  report = json.loads(out.read_text())
  assert (report["meta"]["small_leaf_policy"], report["meta"]["large_leaf_policy"]) == (
      "pack", "in-place")
  # optax's adamw in the same wrappers is the baseline of the mixed case too.
  assert {r["impl"] for r in report["results"]} == {"optirs-apply", "optirs-update", "optax",
                                                    "optax-flatten"}
  for r in report["results"]:
    assert r["ms"] > 0 and r["loop_ms"] > 0 and r["loop_pct_copy"] > 0, r


@pytest.mark.parametrize("argv, message", [
    (["--trees", "foo"], "unknown tree ['foo']; valid trees are"),
    (["--impls", "nope"], "unknown impl ['nope']; valid impls are"),
    (["--optimizers", "adam,adamm"], "unknown optimizer ['adamm']"),
    (["--scale", "-1"], "'-1' must be positive"),
    (["--steps", "0"], "'0' must be positive"),
    (["--steps", "x"], "'x' is not a valid int"),
])
def test_bad_arguments_are_argparse_errors_naming_the_value(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_an_unknown_tree_names_the_valid_ones():
  with pytest.raises(ValueError, match="leaves-flat"):
    bench.tree_shapes("gpt3", 1.0)


def test_case_gradients_are_the_tree_times_the_loss_scale_when_scaled():
  from optirs_jax.bench import cases
  shapes = {"a": (3, 5), "b": (7,)}
  plain = cases.make_grads(shapes, cases.OPTIMIZERS["adam"])
  scaled = cases.make_grads(shapes, cases.OPTIMIZERS["adamw_bf16_master"])
  for name in shapes:
    assert plain[name].dtype == jax.numpy.float32 and scaled[name].dtype == jax.numpy.bfloat16
    ref = jax.numpy.asarray(cases.make_tree(shapes, 1)[name], jax.numpy.bfloat16)
    assert (scaled[name] == ref * jax.numpy.asarray(2.0**15, jax.numpy.bfloat16)).all()
  assert cases.param_count(shapes) == 22


def test_every_option_has_help_and_the_table_headers_are_distinct():
  from optirs_jax.bench import cli
  p = cli.parser()
  for action in p._actions:
    assert action.help, f"{action.option_strings} has no help text"
  report = {"meta": {"date": "d", "device": "cpu: cpu", "versions": {"jax": "x"},
                     "copy_gbps": 1.0, "scale": 1.0}, "results": []}
  header = cli.table(report).splitlines()[-1].split("  ")
  columns = [c.strip() for c in header if c.strip()]
  assert len(columns) == len(set(columns)), columns
  assert "kernel x optax" in columns and "call x optax" in columns


def test_the_catalogue_table_reads_each_optimizer_of_a_committed_gpu_run(capsys):
  """benchmarks/catalogue_table.py on run 49's JSON (an H100): each registry optimizer's
  fused kernel time, % of copy and ratio, and optax's time, as the JSON has them."""
  import pathlib
  import runpy
  root = pathlib.Path(__file__).resolve().parent.parent
  path = root / "benchmarks" / "results" / "2026-12-06-h100-run49-bench.json"
  table = runpy.run_path(str(root / "benchmarks" / "catalogue_table.py"))
  report = json.loads(path.read_text())
  got = {r["optimizer"]: r for r in table["rows"](report)}
  assert sorted(got) == ["adamw", "lion", "sgd"]  # not the 8-bit cases: not registry names
  for r in report["results"]:
    if r["optimizer"] in got and r["impl"] in ("optirs-apply", "optax"):
      row = got[r["optimizer"]]
      if r["impl"] == "optax":
        assert row["optax_ms"] == r["kernel_ms"]
      else:
        assert (row["ms"], row["pct"], row["x_optax"]) == (
            r["kernel_ms"], r["kernel_pct_copy"], r["kernel_x_optax"])
        assert row["met"] == (r["kernel_pct_copy"] >= 95.0)
  assert table["main"]([str(path)]) == 0
  out = capsys.readouterr().out
  assert "| `adamw` | 28 | 1.166 ms (98.3%, 1.21x) | 1.406 ms | 95%: met |" in out
