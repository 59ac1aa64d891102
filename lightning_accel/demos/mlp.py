"""A plain MLP classifier: the smallest model that exercises every capability."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from typing_extensions import override

__all__ = ["MLPClassifier"]


class MLPClassifier(LightningModule):
    """Feed-forward classifier over flat feature vectors.

    Args:
        input_dim: Number of input features.
        hidden_dim: Width of each hidden layer.
        num_layers: Number of hidden ``Linear`` + ``ReLU`` layers.
        num_classes: Number of output classes.
        lr: Learning rate of the default SGD optimizer (used when no optimizer is configured by the CLI).
        dropout: Dropout probability after each hidden layer (0 disables it).
    """

    def __init__(
        self,
        input_dim: int = 32,
        hidden_dim: int = 64,
        num_layers: int = 2,
        num_classes: int = 4,
        lr: float = 0.1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_dim), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
