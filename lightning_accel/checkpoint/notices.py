"""The clouds' preemption notices, read from their documented instance-metadata endpoints (no Trainer in here).

Which cloud a machine is on is read from its own DMI data (:func:`detect_cloud`), never found by probing the
network: off-cloud nothing is polled. Each source speaks one cloud's protocol and turns its answer into a
:class:`Notice` (or ``None``); :class:`NoticeWatcher` polls a source from a thread, so an endpoint that is slow or
unreachable costs training no time.

- AWS EC2 spot: ``PUT /latest/api/token`` (IMDSv2 session token), then ``GET
  /latest/meta-data/spot/instance-action`` with it: 404 until an interruption is scheduled, then
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-12-05T08:22:00Z"}`` (two minutes ahead).
- GCE: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: ``FALSE`` or ``TRUE``;
  ``?wait_for_change=true`` long-polls until it changes. About 30 s between ``TRUE`` and the stop.
- Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``: events, of which
  ``EventType: "Preempt"`` with its ``NotBefore`` time; ``POST`` ``{"StartRequests": [{"EventId": ...}]}`` to the
  same URL acknowledges it (the platform may then go ahead at once: we acknowledge once the save is durable).
"""

from __future__ import annotations

import email.utils
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "AZURE_ASSET_TAG",
    "LEAD_S",
    "METADATA_URLS",
    "SOURCES",
    "AwsSpot",
    "AzureScheduledEvents",
    "GcePreemption",
    "Notice",
    "NoticeError",
    "NoticeSource",
    "NoticeWatcher",
    "detect_cloud",
]

log = logging.getLogger(__name__)

METADATA_URLS = {
    "aws": "http://169.254.169.254",
    "gce": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
LEAD_S = {"aws": 120.0, "gce": 30.0, "azure": 30.0}  # the notice each cloud documents before the machine goes
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"  # Azure's chassis asset tag (Hyper-V elsewhere has another)


def detect_cloud(dmi_dir: str | Path = "/sys/class/dmi/id") -> str | None:
    """``"aws"``, ``"gce"``, ``"azure"`` from this machine's DMI data, or ``None`` (not a cloud we know)."""
    folder = Path(dmi_dir)

    def read(name: str) -> str:
        try:
            return (folder / name).read_text().strip()
        except OSError:
            return ""

    vendor, product = read("sys_vendor"), read("product_name")
    if "Amazon" in vendor or read("bios_vendor") == "Amazon EC2":
        return "aws"
    if vendor == "Google" or product == "Google Compute Engine":
        return "gce"
    if vendor == "Microsoft Corporation" and read("chassis_asset_tag") == AZURE_ASSET_TAG:
        return "azure"
    return None


@dataclass(frozen=True)
class Notice:
    """A preemption the cloud has announced: by when the machine goes (epoch seconds) and what it said."""

    cloud: str
    deadline: float
    detail: str
    event_id: str | None = None  # Azure's, for the acknowledgement

    def seconds_left(self, now: float | None = None) -> float:
        return self.deadline - (time.time() if now is None else now)


class NoticeError(Exception):
    """The endpoint answered, but not as documented (a 5xx, a body we cannot read)."""


class NoticeSource(Protocol):
    cloud: str

    def check(self) -> Notice | None: ...
    def acknowledge(self, notice: Notice) -> None: ...


def _request(url: str, headers: dict[str, str], timeout: float, method: str = "GET", body: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    return urllib.request.urlopen(request, timeout=timeout)


def _read(url: str, headers: dict[str, str], timeout: float, method: str = "GET") -> tuple[int, str]:
    """(status, body); 4xx come back as statuses, 5xx raise :class:`NoticeError`, no answer raises ``OSError``."""
    try:
        with _request(url, headers, timeout, method) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        if error.code >= 500:
            raise NoticeError(f"{url} answered {error.code}") from None
        return error.code, ""


class AwsSpot:
    """EC2 spot interruption notices through IMDSv2 (a session token, renewed when it is refused)."""

    cloud = "aws"

    def __init__(self, base_url: str = METADATA_URLS["aws"], timeout_s: float = 2.0) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self._token: str | None = None

    def _fetch_token(self) -> str:
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
        status, body = _read(f"{self.base_url}/latest/api/token", headers, self.timeout_s, method="PUT")
        if status != 200 or not body:
            raise NoticeError(f"IMDSv2 token request answered {status}")
        return body

    def check(self) -> Notice | None:
        for _ in range(2):  # an expired token is refused with 401: fetch a new one once
            self._token = self._token or self._fetch_token()
            url = f"{self.base_url}/latest/meta-data/spot/instance-action"
            status, body = _read(url, {"X-aws-ec2-metadata-token": self._token}, self.timeout_s)
            if status != 401:
                break
            self._token = None
        if status == 404:
            return None  # no interruption scheduled
        if status != 200:
            raise NoticeError(f"spot/instance-action answered {status}")
        try:
            action = json.loads(body)
            when = datetime.fromisoformat(action["time"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            raise NoticeError(f"spot/instance-action body is not the documented JSON: {body[:200]!r}") from None
        return Notice("aws", when, f"EC2 spot interruption: {action.get('action', '?')} at {action['time']}")

    def acknowledge(self, notice: Notice) -> None:
        pass  # EC2 takes no acknowledgement


class GcePreemption:
    """GCE's ``preempted`` flag, long-polled (``wait_for_change``) so the answer comes when it flips."""

    cloud = "gce"

    def __init__(self, base_url: str = METADATA_URLS["gce"], timeout_s: float = 2.0, wait_s: int = 60) -> None:
        self.base_url, self.timeout_s, self.wait_s = base_url.rstrip("/"), timeout_s, wait_s
        self._etag: str | None = None

    def check(self) -> Notice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        if self._etag is not None:  # first a plain read; then block until the value changes (or wait_s)
            url += f"?wait_for_change=true&timeout_sec={self.wait_s}&last_etag={self._etag}"
        try:
            with _request(url, {"Metadata-Flavor": "Google"}, self.timeout_s + self.wait_s) as answer:
                body, self._etag = answer.read().decode().strip(), answer.headers.get("ETag", "0")
        except urllib.error.HTTPError as error:
            raise NoticeError(f"{url} answered {error.code}") from None
        if body == "FALSE":
            return None
        if body != "TRUE":
            raise NoticeError(f"instance/preempted is neither TRUE nor FALSE: {body[:200]!r}")
        return Notice("gce", time.time() + LEAD_S["gce"], "GCE preemption: the instance is stopped in about 30 s")

    def acknowledge(self, notice: Notice) -> None:
        pass  # GCE takes no acknowledgement


class AzureScheduledEvents:
    """Azure Scheduled Events: a ``Preempt`` event, acknowledged (``StartRequests``) once the save is durable."""

    cloud = "azure"

    def __init__(self, base_url: str = METADATA_URLS["azure"], timeout_s: float = 2.0) -> None:
        self.url = f"{base_url.rstrip('/')}/metadata/scheduledevents?api-version=2020-07-01"
        self.timeout_s = timeout_s

    def check(self) -> Notice | None:
        status, body = _read(self.url, {"Metadata": "true"}, self.timeout_s)
        if status != 200:
            raise NoticeError(f"scheduledevents answered {status}")
        try:
            events = json.loads(body)["Events"]
            preempt = next((e for e in events if e.get("EventType") == "Preempt"), None)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise NoticeError(f"scheduledevents body is not the documented JSON: {body[:200]!r}") from None
        if preempt is None:
            return None
        not_before = preempt.get("NotBefore") or ""
        parsed = email.utils.parsedate_to_datetime(not_before) if not_before else None
        deadline = parsed.timestamp() if parsed is not None else time.time() + LEAD_S["azure"]
        return Notice("azure", deadline, f"Azure Preempt event not before {not_before or '?'}", preempt["EventId"])

    def acknowledge(self, notice: Notice) -> None:
        body = json.dumps({"StartRequests": [{"EventId": notice.event_id}]}).encode()
        headers = {"Metadata": "true", "Content-Type": "application/json"}
        with _request(self.url, headers, self.timeout_s, method="POST", body=body):
            pass


SOURCES: dict[str, Callable[[str], NoticeSource]] = {
    "aws": AwsSpot,
    "gce": GcePreemption,
    "azure": AzureScheduledEvents,
}


class NoticeWatcher:
    """Polls ``source`` every ``interval_s`` from a daemon thread until a notice comes (``notice``) or
    :meth:`stop`. An unreachable endpoint is logged once; a 5xx or an unreadable body is logged (once per
    kind of error) and retried; nothing here raises into training."""

    def __init__(
        self, source: NoticeSource, interval_s: float = 5.0, on_notice: Callable[[Notice], None] | None = None
    ):
        self.source, self.interval_s, self.on_notice = source, interval_s, on_notice
        self.notice: Notice | None = None
        self.errors = 0
        self._stop = threading.Event()
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"lightning_accel-{source.cloud}-notices", daemon=True)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message, *args)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.source.check()
            except NoticeError as error:
                self.errors += 1
                self._log_once(
                    type(error).__name__ + str(error)[:40],
                    "%s preemption notices: %s; retrying",
                    self.source.cloud,
                    error,
                )
                notice = None
            except OSError as error:  # no answer: not on this cloud after all, or its metadata server is down
                self.errors += 1
                self._log_once(
                    "unreachable",
                    "%s preemption notices: the metadata endpoint does not answer (%s); "
                    "retrying every %g s, training is not slowed",
                    self.source.cloud,
                    error,
                    self.interval_s,
                )
                notice = None
            if notice is not None:
                self.notice = notice
                log.warning("%s: %.0f s left", notice.detail, notice.seconds_left())
                if self.on_notice is not None:
                    self.on_notice(notice)
                return
            self._stop.wait(self.interval_s)
