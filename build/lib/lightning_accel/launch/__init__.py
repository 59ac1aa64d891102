"""Launchers that run a recipe on many processes and survive their restarts: torchrun (``torchrun.py``) and
Ray Train (``ray.py``, the optional ``[ray]`` extra: Ray itself is imported only when a run starts)."""

from lightning_accel.launch.ray import RayReport, fit_on_ray, newest_checkpoint, split_ray_args
from lightning_accel.launch.torchrun import exit_launcher, torchrun

__all__ = ["RayReport", "exit_launcher", "fit_on_ray", "newest_checkpoint", "split_ray_args", "torchrun"]
