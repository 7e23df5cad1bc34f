"""A real text corpus on every machine: the CPython standard library's ``.py`` files, as bytes.

Tokens are bytes (256 ids). The files are read in sorted order of their paths relative to the
standard library (``site-packages`` and caches left out); a file is held out when the CRC-32
of its relative path falls in the held-out fraction, so the split is the same on every
machine for the files they share, and a file is never split between the two.

>>> train, held_out = load(limit_bytes=200_000)
>>> train.dtype, int(train.max()) < 256, len(held_out) > 0
(dtype('uint8'), True, True)
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from collections.abc import Iterator

import numpy as np

VOCAB = 256  # byte-level tokens
HELD_OUT = 0.05  # the fraction of files held out


def stdlib_files(root: str | None = None) -> list[str]:
  """The ``.py`` files of the standard library at ``root`` (default: this Python's), as
  paths relative to it, sorted."""
  root = root or sysconfig.get_paths()["stdlib"]
  out = []
  for here, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages",
                                                   "__pycache__"))
    out += [os.path.relpath(os.path.join(here, f), root) for f in files if f.endswith(".py")]
  return sorted(out)


def is_held_out(relpath: str, fraction: float = HELD_OUT) -> bool:
  """Whether the file at ``relpath`` belongs to the held-out split."""
  return zlib.crc32(relpath.replace(os.sep, "/").encode()) < fraction * 2**32


def load(limit_bytes: int | None = None, root: str | None = None,
         fraction: float = HELD_OUT) -> tuple[np.ndarray, np.ndarray]:
  """``(train, held_out)`` byte arrays (uint8): the files of each split, concatenated in
  path order; with ``limit_bytes``, each split stops after the file that crosses it."""
  root = root or sysconfig.get_paths()["stdlib"]
  parts: dict[bool, list[bytes]] = {False: [], True: []}
  sizes = {False: 0, True: 0}
  for rel in stdlib_files(root):
    held = is_held_out(rel, fraction)
    if limit_bytes is not None and sizes[held] >= limit_bytes:
      continue
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read()
    parts[held].append(data)
    sizes[held] += len(data)
  if not parts[True] or not parts[False]:
    raise ValueError(f"the corpus at {root} has no files in one of its splits "
                     f"({len(parts[False])} train, {len(parts[True])} held out)")
  as_array = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)
  return as_array(parts[False]), as_array(parts[True])


def fingerprint(data: np.ndarray) -> str:
  """A short hash of a split's bytes (the JSON records which corpus a run saw)."""
  return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def batches(data: np.ndarray, batch: int, context: int, seed: int) -> Iterator[np.ndarray]:
  """Endless ``[batch, context + 1]`` int32 windows at random offsets (a fixed ``seed``: the
  same batches for every configuration): inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
  if len(data) <= context + 1:
    raise ValueError(f"the split has {len(data)} bytes: too few for windows of {context + 1}")
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - context - 1, batch)
    yield np.stack([data[s:s + context + 1] for s in starts]).astype(np.int32)
