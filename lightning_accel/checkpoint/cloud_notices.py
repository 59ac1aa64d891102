"""PreemptionNotices: a cloud's preemption notice stops the run as SIGTERM does, before the machine is taken."""

from __future__ import annotations

import logging
import os

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_accel.checkpoint.async_io import AsyncAtomicCheckpointIO
from lightning_accel.checkpoint.notices import LEAD_S, METADATA_URLS, SOURCES, Notice, NoticeWatcher, detect_cloud
from lightning_accel.checkpoint.preemption import Preempted, PreemptionCheckpoint

__all__ = ["PreemptionNotices", "cloud_from_env_or_dmi"]

log = logging.getLogger(__name__)


def cloud_from_env_or_dmi(dmi_dir: str) -> str | None:
    """``LIGHTNING_ACCEL_CLOUD`` when set (``none`` turns notices off: our test suite sets it), else the DMI data."""
    chosen = os.environ.get("LIGHTNING_ACCEL_CLOUD", "").strip().lower()
    if not chosen:
        return detect_cloud(dmi_dir)
    if chosen == "none":
        return None
    if chosen not in SOURCES:
        raise ValueError(f"LIGHTNING_ACCEL_CLOUD={chosen!r}: use one of {sorted(SOURCES)} or 'none'")
    return chosen


class PreemptionNotices(Callback):
    """Read the cloud's preemption notice and hand it to :class:`PreemptionCheckpoint` as if a signal had come:
    at the next step boundary every rank saves, and the run exits with code 75 before the deadline.

    One process per node (local rank 0) polls, from a thread; the checkpoint's vote at each step boundary carries
    the notice to every rank. Once the save is durable the margin left before the deadline is logged, and
    Azure's event is acknowledged. Kubernetes and SLURM announce preemptions as signals: ``PreemptionCheckpoint``
    handles those by itself.

    Args:
        cloud: ``"auto"``: ``LIGHTNING_ACCEL_CLOUD`` (``aws``, ``gce``, ``azure`` or ``none``) if set, else this
            machine's DMI data (``/sys/class/dmi/id``); off-cloud nothing is polled and no thread starts.
            Or ``"aws"``, ``"gce"``, ``"azure"``; ``None`` turns it off.
        metadata_url: Base URL of the metadata server; default: the cloud's documented address.
        poll_s: Seconds between polls (GCE long-polls: it answers when the flag changes).
        dmi_dir: Where DMI data is read from for ``"auto"``.
    """

    def __init__(
        self,
        cloud: str | None = "auto",
        metadata_url: str | None = None,
        poll_s: float = 5.0,
        dmi_dir: str = "/sys/class/dmi/id",
    ) -> None:
        if cloud not in (None, "auto", *SOURCES):
            raise ValueError(
                f"PreemptionNotices: cloud must be 'auto', None or one of {sorted(SOURCES)}, got {cloud!r}"
            )
        if poll_s <= 0:
            raise ValueError(f"PreemptionNotices: poll_s must be > 0, got {poll_s}")
        self.cloud, self.metadata_url, self.poll_s, self.dmi_dir = cloud, metadata_url, poll_s, dmi_dir
        self.watcher: NoticeWatcher | None = None
        self.margin_s: float | None = None  # seconds left before the deadline once the save was durable

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.watcher, self.margin_s = None, None
        if stage != "fit" or self.cloud is None:
            return
        checkpoint = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        if checkpoint is None:
            raise ValueError(
                "PreemptionNotices needs a PreemptionCheckpoint among the Trainer's callbacks: it is what saves "
                "when a notice comes. Add la.PreemptionCheckpoint(dirpath=...)"
            )
        self._checkpoint = checkpoint
        cloud = self.cloud if self.cloud != "auto" else cloud_from_env_or_dmi(self.dmi_dir)
        if cloud is None:
            log.info("PreemptionNotices: this machine's DMI data names no cloud we know; no notices are polled")
            return
        checkpoint.limit_grace(LEAD_S[cloud])  # the first save longer than the notice's lead then warns
        if trainer.local_rank != 0:
            return
        source = SOURCES[cloud](self.metadata_url or METADATA_URLS[cloud])
        self.watcher = NoticeWatcher(source, self.poll_s, on_notice=self._on_notice).start()
        log.info(
            "PreemptionNotices: watching %s preemption notices at %s", cloud, self.metadata_url or METADATA_URLS[cloud]
        )

    def _on_notice(self, notice: Notice) -> None:
        saves = self._checkpoint.save_seconds
        if saves and max(saves) > notice.seconds_left():
            log.warning(
                "%s, but saves here have taken up to %.1f s: the save may not be durable in time",
                notice.detail,
                max(saves),
            )
        self._checkpoint.request_stop(notice.detail)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_watching()
        watcher = self.watcher
        if not isinstance(exception, Preempted) or watcher is None or watcher.notice is None:
            return
        if isinstance(trainer.strategy.checkpoint_io, AsyncAtomicCheckpointIO):
            trainer.strategy.checkpoint_io.wait()  # durable before the margin is measured and Azure is told
        notice = watcher.notice
        self.margin_s = notice.seconds_left()
        saved = (
            f"saved {exception.checkpoint}"
            if exception.checkpoint
            else "stopped before the first step (nothing to save)"
        )
        log.warning("%s with %.1f s left before the %s deadline", saved, self.margin_s, notice.cloud)
        try:
            watcher.source.acknowledge(notice)
        except OSError as error:
            log.warning("could not acknowledge the %s event %s: %s", notice.cloud, notice.event_id, error)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()  # kept: `watcher.notice` says after fit what came
