"""The optimizers as optax GradientTransformations (one fused update each)."""

from optirs_jax.transforms.adagrad import AdagradState, adagrad
from optirs_jax.transforms.adam import AdamState, adam, adamw, lamb
from optirs_jax.transforms.rmsprop import RmspropState, rmsprop
from optirs_jax.transforms.sgd import SgdState, sgd

__all__ = ["AdagradState", "AdamState", "RmspropState", "SgdState", "adagrad", "adam", "adamw",
           "lamb", "rmsprop", "sgd"]
