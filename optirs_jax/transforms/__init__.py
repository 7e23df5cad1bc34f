"""The optimizers: one spec and one public function each, built by one builder."""

from optirs_jax.transforms._builder import build
from optirs_jax.transforms.adagrad import AdagradState, adagrad
from optirs_jax.transforms.adam import AdamState, adam, adamw
from optirs_jax.transforms.lamb import lamb
from optirs_jax.transforms.lion import LionState, lion
from optirs_jax.transforms.rmsprop import RmspropState, rmsprop
from optirs_jax.transforms.sgd import SgdState, sgd

__all__ = ["AdagradState", "AdamState", "LionState", "RmspropState", "SgdState", "adagrad",
           "adam", "adamw", "build", "lamb", "lion", "rmsprop", "sgd"]
