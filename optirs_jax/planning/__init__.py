"""Pure-CPU, GPU-aware planning models. Nothing here needs a device."""

from optirs_jax.planning.layout import Group, LayoutPlan, Placement, padded_size, plan_layout

__all__ = ["Group", "LayoutPlan", "Placement", "padded_size", "plan_layout"]
