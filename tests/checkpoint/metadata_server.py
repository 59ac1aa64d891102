"""A metadata server on 127.0.0.1 that answers as AWS IMDSv2, GCE and Azure Scheduled Events document it.

Tests post a notice (``post_notice``) mid-run, make it fail (``fail_next`` 5xx answers, ``garbage_next`` unreadable
bodies), and read what it was asked (``requests``) and acknowledged (``acks``).
"""

from __future__ import annotations

import email.utils
import json
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

TOKEN = "AQAEAtoken=="


class MetadataServer:
    def __init__(self) -> None:
        self.deadline: float | None = None
        self.fail_next = 0
        self.garbage_next = 0
        self.requests: list[tuple[str, str]] = []
        self.acks: list[dict] = []
        self.changed = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def answer(self, status: int, body: str = "", headers: dict | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def broken(self) -> bool:
                if server.fail_next > 0:
                    server.fail_next -= 1
                    self.answer(503, "unavailable")
                    return True
                return False

            def do_PUT(self):
                server.requests.append(("PUT", self.path))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self.answer(200, TOKEN)
                self.answer(400)

            def do_GET(self):
                server.requests.append(("GET", self.path))
                url = urlparse(self.path)
                if self.broken():
                    return
                if url.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                        return self.answer(401)
                    if server.garbage_next > 0:
                        server.garbage_next -= 1
                        return self.answer(200, "<html>not json</html>")
                    if server.deadline is None:
                        return self.answer(404)
                    when = datetime.fromtimestamp(server.deadline, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    return self.answer(200, json.dumps({"action": "terminate", "time": when}))
                if url.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self.answer(403)
                    query = parse_qs(url.query)
                    if query.get("wait_for_change") == ["true"]:
                        with server.changed:
                            server.changed.wait_for(
                                lambda: server.deadline is not None, timeout=float(query.get("timeout_sec", ["60"])[0])
                            )
                    if server.garbage_next > 0:
                        server.garbage_next -= 1
                        return self.answer(200, "MAYBE", {"Metadata-Flavor": "Google", "ETag": "1"})
                    value = "TRUE" if server.deadline is not None else "FALSE"
                    return self.answer(200, value, {"Metadata-Flavor": "Google", "ETag": value})
                if url.path == "/metadata/scheduledevents":
                    if self.headers.get("Metadata") != "true":
                        return self.answer(400)
                    if server.garbage_next > 0:
                        server.garbage_next -= 1
                        return self.answer(200, "{")
                    events = []
                    if server.deadline is not None:
                        events.append(
                            {
                                "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                                "EventType": "Preempt",
                                "ResourceType": "VirtualMachine",
                                "Resources": ["vm-0"],
                                "EventStatus": "Scheduled",
                                "NotBefore": email.utils.formatdate(server.deadline, usegmt=True),
                                "Description": "",
                                "EventSource": "Platform",
                                "DurationInSeconds": -1,
                            }
                        )
                    return self.answer(200, json.dumps({"DocumentIncarnation": len(events), "Events": events}))
                self.answer(404)

            def do_POST(self):
                server.requests.append(("POST", self.path))
                if urlparse(self.path).path == "/test/notice":  # the tests' own control: post a notice now
                    server.post_notice(float(parse_qs(urlparse(self.path).query)["seconds"][0]))
                    return self.answer(200)
                if urlparse(self.path).path == "/metadata/scheduledevents" and self.headers.get("Metadata") == "true":
                    length = int(self.headers.get("Content-Length", "0"))
                    server.acks.append({"body": json.loads(self.rfile.read(length)), "at": time.time()})
                    return self.answer(200)
                self.answer(400)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def post_notice(self, seconds: float) -> None:
        with self.changed:
            self.deadline = time.time() + seconds
            self.changed.notify_all()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
