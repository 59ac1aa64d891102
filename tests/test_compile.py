"""TorchCompile: compiled training matches eager, failures fall back (or raise), modules are restored."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_accel._compat import dynamo_counters, graph_break
from lightning_accel.compile import TorchCompile
from lightning_accel.demos import MLPClassifier, SyntheticClassificationDataModule

from .conftest import tiny_trainer_kwargs


class GraphBreakMLP(MLPClassifier):
    """A forward that cannot be captured as one graph: fails under fullgraph=True."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        graph_break()
        return self.net(x)


def train(tmp_path, model: MLPClassifier, callbacks, steps: int = 6) -> list[float]:
    seed_everything(0)
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    dm = SyntheticClassificationDataModule(num_samples=256, input_dim=16, num_classes=4, batch_size=32)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=steps, callbacks=[*callbacks, Record()]))
    trainer.fit(model, datamodule=dm)
    return losses


def fresh(cls=MLPClassifier) -> MLPClassifier:
    torch.manual_seed(0)
    return cls(input_dim=16, hidden_dim=32, num_classes=4)


@pytest.mark.slow
def test_inductor_compiled_losses_match_eager(tmp_path):
    eager = train(tmp_path, fresh(), [])
    cb = TorchCompile()
    compiled = train(tmp_path, fresh(), [cb])
    assert cb.failed == {}
    assert set(cb.compile_time_s) == {"MLPClassifier", "backward"} and min(cb.compile_time_s.values()) > 0
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    assert compiled != pytest.approx([compiled[0]] * len(compiled))  # it trained


def test_failed_compilation_falls_back_to_eager(tmp_path, caplog):
    eager = train(tmp_path, fresh(GraphBreakMLP), [])
    cb = TorchCompile(fullgraph=True, backend="eager")
    with caplog.at_level("WARNING", logger="lightning_accel.compile"):
        fallback = train(tmp_path, fresh(GraphBreakMLP), [cb])
    assert list(cb.failed) == ["GraphBreakMLP"]
    assert "running it eagerly" in caplog.text
    assert cb.compile_time_s == {}
    assert fallback == eager  # the eager path, bit for bit


def test_failed_compilation_raises_when_fallback_disabled(tmp_path):
    with pytest.raises(Exception, match=r"graph_break|Unsupported|graph break"):
        train(tmp_path, fresh(GraphBreakMLP), [TorchCompile(fullgraph=True, backend="eager", fallback=False)])


def test_named_submodule_is_compiled_and_restored(tmp_path):
    model = fresh()
    cb = TorchCompile(modules=["net"], backend="aot_eager")
    train(tmp_path, model, [cb], steps=2)
    assert set(cb.compile_time_s) == {"net", "backward"}
    assert "forward" not in model.net.__dict__  # teardown gave the module its eager forward back


def test_unknown_submodule_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="has no submodule 'encoder'"):
        train(tmp_path, fresh(), [TorchCompile(modules=["encoder"])], steps=1)


def test_compiles_beside_a_flop_count_of_the_first_batch(tmp_path):
    """GoodputMonitor counts FLOPs of the first batch under a FlopCounterMode; a compiled forward first called
    under it used to be skipped by dynamo for good (the whole run eager, silently). Now that batch runs
    eagerly and the next one compiles: dynamo captures a graph and the compile time is recorded."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_accel.monitor import GoodputMonitor

    torch.compiler.reset()
    dynamo_counters().clear()
    compile_cb = TorchCompile(backend="eager", fallback=False)
    monitor = GoodputMonitor(summary=False, plot=False, warmup_steps=0)
    trainer = Trainer(**tiny_trainer_kwargs(tmp_path, max_steps=4, callbacks=[monitor, compile_cb]))
    trainer.fit(BoringModel())
    assert dynamo_counters()["stats"]["unique_graphs"] >= 1
    assert "BoringModel" in compile_cb.compile_time_s and not compile_cb.failed
    assert monitor.flops_per_batch and monitor.flops_per_batch > 0  # the eager first batch was still counted
