"""Accuracy of a Gram Newton–Schulz iteration against Muon's standard chain, on the CPU.

    PYTHONPATH=. python3 benchmarks/gram_ns_accuracy.py

Each step of the quintic iteration multiplies the iterate on the left by a polynomial of
its Gram matrix, so ``X_k = Q_k X_0`` with ``Q_k`` a polynomial of ``A_0 = X_0 X_0^T``:
``A_k = Q_k A_0 Q_k`` and ``Q_{k+1} = (c0 I + c1 A_k + c2 A_k^2) Q_k``. For a wide matrix
(``m`` rows, ``n >> m`` columns: GPT-2's 768 x 50257 embedding) the work is two ``m x m x n``
products instead of three per step. Printed: the relative Frobenius error against the
standard chain in float32 of the standard chain in bfloat16 (``ns_dtype=jnp.bfloat16``)
and of the Gram form with every product in float32, with ``A_0`` in bfloat16, and with
``A_0`` in float32 and only the last product in bfloat16, and that with the ``m x m``
iteration's products on TF32 inputs (what a GPU's default float32 precision does); on
Gaussian matrices and on ones with singular values decaying as ``k^-1.5``
(ill-conditioned, as momenta are).

Then the forms built (``optirs_jax.orthogonal.orthogonalize_stack`` with
``ns_dtype=jnp.bfloat16``) against optax's chain in float64 numpy: the Gram form
(``orthogonal/_gram_form.py``: ``A_0`` from the bfloat16 stack with float32 sums, the
``m x m`` iteration in bf16x3 products, ``Q_5 X_0`` in two bfloat16 parts), the chain step
by step with the factor as a square, and with the factor expanded; on the matrices above
and on one of rank 30 (a vocabulary's momentum has rows of tokens never seen).
"""

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")
C0, C1, C2 = 3.4445, -4.7750, 2.0315


def standard(x, dtype):
  x = x.astype(dtype)
  x = x / (jnp.linalg.norm(x.astype(jnp.float32)).astype(dtype) + 1e-8)
  for _ in range(5):
    a = x @ x.T
    x = C0 * x + (C1 * a + C2 * a @ a) @ x
  return x.astype(jnp.float32)


def tf32(x):
  """``x`` rounded to TF32's 10 mantissa bits (nearest, ties to even): a tensor core's
  float32 product rounds its inputs so (jax's default precision on an NVIDIA GPU)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  i = (i + 0xFFF + ((i >> 13) & 1)) & jnp.uint32(0xFFFFE000)
  return jax.lax.bitcast_convert_type(i, jnp.float32)


def gram(x, first, last, iterate=lambda a: a):
  """The Gram form: ``A_0`` from ``x`` in ``first``, the ``m x m`` iteration in float32
  (each product's inputs through ``iterate``: :func:`tf32` for TF32 tensor cores), the last
  product ``Q_5 X_0`` in ``last``."""
  x = x / (jnp.linalg.norm(x) + 1e-8)
  eye = jnp.eye(x.shape[0], dtype=jnp.float32)
  xf = x.astype(first)
  a0 = (xf @ xf.T).astype(jnp.float32)
  q = eye
  mm = lambda a, b: iterate(a) @ iterate(b)
  for _ in range(5):
    a = mm(mm(q, a0), q)
    q = mm(C0 * eye + C1 * a + C2 * mm(a, a), q)
  return (q.astype(last) @ x.astype(last)).astype(jnp.float32)


def main():
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  f32, bf16 = jnp.float32, jnp.bfloat16
  print(f"{'matrix':<22}{'bf16 chain':>11}{'gram f32':>10}{'gram A0 bf16':>14}"
        f"{'gram last bf16':>16}{'+ iterate TF32':>16}")
  for m, n in [(128, 512), (128, 8192), (256, 16384)]:
    for kind in ("gaussian", "decaying"):
      x = jax.random.normal(jax.random.PRNGKey(m + n), (m, n))
      if kind == "decaying":
        u, _, vt = jnp.linalg.svd(x, full_matrices=False)
        x = (u * jnp.arange(1, m + 1.0) ** -1.5) @ vt
      ref = standard(x, f32)
      print(f"{f'{m}x{n} {kind}':<22}{rel(standard(x, bf16), ref):11.4f}"
            f"{rel(gram(x, f32, f32), ref):10.1e}{rel(gram(x, bf16, bf16), ref):14.4f}"
            f"{rel(gram(x, f32, bf16), ref):16.4f}"
            f"{rel(gram(x, f32, bf16, tf32), ref):16.4f}", flush=True)


def optax_chain_f64(x):
  """optax's chain (Frobenius, five standard steps) on a wide matrix, in float64 numpy."""
  w = x / (np.linalg.norm(x) + 1e-8)
  for _ in range(5):
    a = w @ w.T
    w = C0 * w + (C1 * a + C2 * a @ a) @ w
  return w


def built():
  from unittest import mock

  from optirs_jax.orthogonal import _gram_form, orthogonalize_stack
  from optirs_jax.orthogonal._newton_schulz import PRESETS

  def run(x, gram, square):
    with mock.patch.object(_gram_form, "RATIO", 16 if gram else 10**9):
      return np.asarray(orthogonalize_stack(jnp.asarray(x[None], jnp.float32),
                                            jnp.asarray(PRESETS["standard"]), 5,
                                            ns_dtype=jnp.bfloat16, square=square)[0],
                        np.float64)

  print(f"\n{'bfloat16 forms against float64':<32}{'Gram form':>10}{'square':>9}"
        f"{'expanded':>10}")
  for m, n in [(64, 2048), (256, 16384)]:
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(m + n), (m, n)), np.float64)
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    kinds = {"gaussian": g, "decaying": (u * np.arange(1, m + 1.0) ** -1.5) @ vt,
             "rank 30": g * (np.arange(n) < 30)}
    for kind, x in kinds.items():
      want = optax_chain_f64(x)
      err = [np.linalg.norm(run(x, *f) - want) / np.linalg.norm(want)
             for f in [(True, True), (False, True), (False, False)]]
      print(f"{f'{m}x{n} {kind}':<32}{err[0]:10.4f}{err[1]:9.4f}{err[2]:10.4f}", flush=True)


if __name__ == "__main__":
  main()
  built()
