"""Small reference models used by the recipes, tests and benchmarks."""

from lightning_accel.models.mlp import MLPClassifier
from lightning_accel.models.tiny_gpt import GPTBlock, TinyGPT

__all__ = ["GPTBlock", "MLPClassifier", "TinyGPT"]
