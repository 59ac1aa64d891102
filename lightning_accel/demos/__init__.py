"""Demo models and data, as Lightning's ``lightning.pytorch.demos``: what the recipes, guides, tests and benchmarks
train. Small, seeded, no download; the data resumes mid-epoch. Not part of what the suite does to a user's run."""

from lightning_accel.demos.mlp import MLPClassifier
from lightning_accel.demos.synthetic import SyntheticClassificationDataModule, SyntheticTokenDataModule
from lightning_accel.demos.tiny_gpt import GPTBlock, TinyGPT

__all__ = ["GPTBlock", "MLPClassifier", "SyntheticClassificationDataModule", "SyntheticTokenDataModule", "TinyGPT"]
