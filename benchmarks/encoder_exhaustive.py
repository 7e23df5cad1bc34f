"""The dynamic map's encoder against numpy's sorted search on every float32 in [0, 1].

    PYTHONPATH=. JAX_PLATFORMS=cpu python3 benchmarks/encoder_exhaustive.py [--every N]
        [--coder table|arithmetic]

``optirs_jax.formats.codes.encode_magnitude`` finds a code in two lookups (a bucket of the
float's exponent and top mantissa bits, then one threshold). This runs it, jitted, over
every ``N``-th float32 bit pattern from 0 to 1 (``N = 1``: all 1,065,353,217 of them) for
the signed (7-bit) and the unsigned (8-bit) map, in chunks of 16M values, and counts where
its code differs from bitsandbytes' rule written in numpy: the largest magnitude at most
``a`` (``np.searchsorted``) or the next one, the nearer, the smaller on a tie.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax.formats.codes import encode_magnitude, magnitude_table


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--every", type=int, default=1, help="every N-th float32 (default 1)")
  parser.add_argument("--coder", default="table", choices=("table", "arithmetic"),
                      help="the threshold by lookup (table) or by its test on two "
                           "magnitudes computed from the decade constants (arithmetic)")
  args = parser.parse_args()
  top = int(np.float32(1).view(np.uint32))
  chunk = (1 << 24) * args.every
  for bits in (7, 8):
    table = np.asarray(magnitude_table(bits))
    encode = jax.jit(lambda a, bits=bits: encode_magnitude(a, bits, coder=args.coder))
    start, checked, wrong = time.perf_counter(), 0, 0
    for lo in range(0, top + 1, chunk):
      a = np.arange(lo, min(lo + chunk, top + 1), args.every, dtype=np.uint32).view(np.float32)
      m0 = np.searchsorted(table, a, side="right") - 1
      m1 = np.minimum(m0 + 1, len(table) - 1)
      want = np.where(table[m1] - a < a - table[m0], m1, m0)
      wrong += int((np.asarray(encode(jnp.asarray(a))) != want).sum())
      checked += len(a)
      print(f"\r{bits}-bit map: {checked:,} values", end="", flush=True)
    print(f"\r{bits}-bit map, {args.coder} coder: {checked:,} float32 values in [0, 1], "
          f"{wrong} codes differ "
          f"from the search ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
  main()
