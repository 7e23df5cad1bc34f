"""TFLOP/s of optirs_jax.planning.tensor_cores.gemm per input precision, on random data.

    PYTHONPATH=. python3 benchmarks/gemm_tflops.py [N]
"""

import statistics
import sys
import time

import jax

from optirs_jax.planning.tensor_cores import gemm


def main(n: int = 8192):
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a, b = jax.random.normal(ka, (n, n)), jax.random.normal(kb, (n, n))
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {n}x{n}x{n}, random data")
  for precision in ("fp32", "tf32", "fp16", "bf16", "fp8"):
    f = jax.jit(lambda a, b, p=precision: gemm(a, b, p))
    try:
      xa, xb = a, b
      f(xa, xb).block_until_ready()
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
          out = f(xa, xb)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / 10)
      sec = statistics.median(times)
      print(f"{precision:<5} {sec * 1e3:8.3f} ms  {2 * n**3 / sec / 1e12:7.1f} TFLOP/s", flush=True)
    except Exception as e:  # a precision the device cannot run is reported, not fatal
      print(f"{precision:<5} failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
