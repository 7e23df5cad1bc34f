"""The training benchmark (optirs_jax.bench.train): its corpus, its model, and one tiny run of
its configurations on the CPU, each in a process of its own."""

import json
import os
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest
from flax import nnx

from optirs_jax.bench import corpus
from optirs_jax.bench.gpt import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_corpus_is_the_standard_library_split_by_file():
  root = sysconfig.get_paths()["stdlib"]
  files = corpus.stdlib_files()
  assert "os.py" in files and "json/__init__.py".replace("/", os.sep) in files
  assert not any("site-packages" in f or "__pycache__" in f for f in files)
  held = [f for f in files if corpus.is_held_out(f)]
  assert 0.02 < len(held) / len(files) < 0.08  # about 5% of the files
  train, held_out = corpus.load(limit_bytes=100_000)
  # The held-out bytes are the first held-out files' bytes, in path order: none is trained on.
  with open(os.path.join(root, held[0]), "rb") as f:
    first = f.read()
  assert held_out[:len(first)].tobytes() == first
  assert first not in train.tobytes()


def test_batches_are_windows_of_the_split_and_repeat_with_the_seed():
  data = np.arange(1000, dtype=np.uint8)
  a = next(corpus.batches(data, 4, 16, seed=3))
  b = next(corpus.batches(data, 4, 16, seed=3))
  assert a.shape == (4, 17) and (a == b).all()
  assert (np.diff(a.astype(np.int64) % 256, axis=1) % 256 == 1).all()  # contiguous windows
  with pytest.raises(ValueError, match="too few"):
    next(corpus.batches(data[:10], 4, 16, seed=0))


def test_the_model_has_gpt2_smalls_parameter_count():
  assert GPTConfig.preset("gpt2").parameters() == 124_439_808  # GPT-2 small, as published
  config = GPTConfig.preset("tiny")
  model = GPT(config, nnx.Rngs(0))
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == config.parameters()
  with pytest.raises(ValueError, match="unknown model 'huge'; valid"):
    GPTConfig.preset("huge")
  with pytest.raises(ValueError, match="not a multiple of heads"):
    GPTConfig.preset("tiny", heads=3)


def _bench(*args):
  # Without excess precision XLA rounds every bfloat16 intermediate of the model: otherwise
  # which ones it keeps in float32 depends on how it fuses the step, which the optimizer's
  # part changes (the bfloat16 runs then differ in the loss's sixth digit).
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_allow_excess_precision=false")
  return subprocess.run([sys.executable, "-m", "optirs_jax.bench.train", *args], env=env,
                        capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_a_tiny_run_trains_each_configuration_and_optirs_matches_optax(tmp_path):
  out = tmp_path / "train.json"
  proc = _bench("--model", "tiny", "--configs", "optax,optirs-fused,optax-bf16-master,bf16-master",
                "--steps", "4", "--batch", "2", "--eval-every", "2", "--eval-batches", "1",
                "--timing-steps", "1", "--corpus-bytes", "200000", "--json", str(out))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["meta"]["device"].startswith("cpu") and report["model"] == "tiny"
  assert report["meta"]["corpus"]["train_bytes"] > 0
  results = report["results"]
  assert list(results) == ["optax", "optirs-fused", "optax-bf16-master", "bf16-master"]
  for r in results.values():
    assert len(r["losses"]) == 4 and [e["step"] for e in r["evals"]] == [2, 4]
    assert r["parameters"] == GPTConfig.preset("tiny").parameters()
    assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["first_call_s"] > 0
    assert r["kernel_ms"] is None  # no device plane in a CPU trace
    compiled = r["compiled"]  # the step, the gradients and the optimizer, compiled
    assert compiled["step"]["fusions"] > compiled["gradients"]["fusions"] > 0
    assert compiled["optimizer"]["fusions"] > 0 and compiled["step"]["custom_calls"] == 0
  assert results["optirs-fused"]["path"] == "fused: chain(clip_by_global_norm, adamw)"
  assert results["optax"]["path"].startswith("update + apply_updates")
  assert results["bf16-master"]["path"].startswith("fused: with_loss_scaling(master_weights(")
  assert results["optax-bf16-master"]["path"].startswith("update + apply_updates")
  # optax's numbers bit for bit (the reference executor on a CPU), float32 and bfloat16.
  for ours, theirs in (("optirs-fused", "optax"), ("bf16-master", "optax-bf16-master")):
    np.testing.assert_array_equal(results[ours]["losses"], results[theirs]["losses"])
    np.testing.assert_array_equal([e["held_out"] for e in results[ours]["evals"]],
                                  [e["held_out"] for e in results[theirs]["evals"]])
  assert "optirs-fused" in proc.stdout and "held-out" in proc.stdout  # the table
  assert "what XLA fuses into or adds around the optimizer" in proc.stdout


def test_bad_arguments_name_the_value_and_the_valid_ones():
  proc = _bench("--configs", "optax,adamw9bit")
  assert proc.returncode == 2
  assert "unknown configuration 'adamw9bit'; valid: ['optax'" in proc.stderr
  proc = _bench("--steps", "0")
  assert proc.returncode == 2 and "--steps must be at least 1, got 0" in proc.stderr


@pytest.mark.parametrize("n, threshold", [(12, -1), (12, 0), (12, 6), (12, 11), (1, 0), (5, 3)])
def test_the_search_finds_the_largest_rung_in_log_steps(n, threshold):
  from optirs_jax.bench.largest import largest_fitting
  k, tried = largest_fitting(n, lambda i: i <= threshold)
  assert k == threshold and len(tried) <= (n + 1).bit_length()
  assert len(set(tried)) == len(tried)  # no rung twice


def test_the_largest_model_search_runs_each_attempt_in_a_process(tmp_path):
  out = tmp_path / "largest.json"
  proc = _bench("--largest", "--model", "tiny", "--configs", "optirs-fused", "--ladder",
                "1x64,2x128,3x192", "--batch", "2", "--corpus-bytes", "100000",
                "--memory-fraction", "0.5", "--json", str(out))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())["results"]["optirs-fused"]
  model = GPT(GPTConfig.preset("tiny").scaled(3, 192), nnx.Rngs(0))
  assert r["largest"]["layers"] == 3 and r["largest"]["width"] == 192
  assert r["largest"]["parameters"] == sum(x.size for x in jax.tree.leaves(
      nnx.state(model, nnx.Param)))
  assert [(a["layers"], a["fits"]) for a in r["attempts"]] == [(2, True), (3, True)]
  assert {a["memory_fraction"] for a in r["attempts"]} == {"0.5"}  # JAX's share, passed on
  # the batch it ran (activations decide the peak as much as the optimizer does)
  assert {(a["batch"], a["context"]) for a in r["attempts"]} == {(2, 64)}
  assert "2x64" in proc.stdout
  # Each phase timed (the first step holds the trace and the compile).
  for a in r["attempts"]:
    assert a["first_step_s"] > a["second_step_s"] > 0 and a["build_s"] > 0, a
  proc = _bench("--largest", "--ladder", "12by768")
  assert proc.returncode == 2 and "a ladder is comma-separated LAYERSxWIDTH" in proc.stderr
  proc = _bench("--largest", "--memory-fraction", "1.5")
  assert proc.returncode == 2 and "--memory-fraction must be in (0, 1], got 1.5" in proc.stderr


def test_an_attempt_past_its_timeout_does_not_fit(tmp_path):
  """Over the device's memory XLA's allocator retries instead of failing: an attempt that
  runs past --attempt-timeout counts as not fitting, and says so."""
  out = tmp_path / "largest.json"
  proc = _bench("--largest", "--model", "tiny", "--configs", "optax", "--ladder", "1x64,2x128",
                "--attempt-timeout", "0.01", "--corpus-bytes", "100000", "--json", str(out))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())["results"]["optax"]
  assert r["largest"] is None
  assert [(a["layers"], a["fits"]) for a in r["attempts"]] == [(2, False), (1, False)]
  assert "timed out after 0.01 s" in r["attempts"][0]["error"]
  assert "optax 1x64: does not fit" in proc.stderr


def test_a_failed_attempt_names_the_childs_last_error_line():
  from optirs_jax.bench.train import _last_error
  log = ("W0000 warming up\nTraceback (most recent call last):\n  File 'x.py'\n"
         "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
         "allocate 20.00GiB\n  optax 56x3072: progress\n")
  assert _last_error(log).startswith("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED")
  folding = "Constant folding an instruction is taking > 2s:\n\n  %gather.603 = f32[16]\n"
  assert _last_error(folding) == "%gather.603 = f32[16]"  # no error: the last line
  assert _last_error("") == ""


def test_the_table_says_where_the_step_saves_less_than_the_optimizer_and_why():
  from optirs_jax.bench.train import savings
  compiled = {"step": {"fusions": 147, "custom_calls": 0},
              "gradients": {"fusions": 100, "custom_calls": 0},
              "optimizer": {"fusions": 106, "custom_calls": 0}}
  results = {
      "optax": {"kernel_ms": 3.50, "optimizer_kernel_ms": 0.40, "compiled": compiled},
      "held": {"kernel_ms": 3.39, "optimizer_kernel_ms": 0.30},  # 0.11 in the step
      "short": {"kernel_ms": 3.45, "optimizer_kernel_ms": 0.20},  # 0.05 of 0.20
      "slower": {"kernel_ms": 3.60, "optimizer_kernel_ms": 0.45},  # -0.05 alone, -0.10
      "failed": {"error": "exit 1"},
  }
  rows = savings(results)
  assert len(rows) == 4  # the heading, then held, short and slower (not the failed one)
  assert rows[1].startswith("held: alone 0.100 ms less") and rows[1].endswith("all of it")
  assert "the step is 0.150 ms short" in rows[2] and "fuses 59 of optax's 106" in rows[2]
  assert rows[3].startswith("slower: alone 0.050 ms more") and "0.050 ms short" in rows[3]
  # Without the reference's compiled programs no cause is named; without optax, no rows.
  del results["optax"]["compiled"]
  assert "not explained here" in savings(results)[2]
  assert savings({"held": results["held"]}) == []
  results["optax"]["optimizer_kernel_ms"] = None  # a CPU run: no kernel times, no rows
  assert savings(results) == []
