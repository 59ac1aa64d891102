"""The network benchmarks/object_storage.py models between a client and the S3 server on 127.0.0.1: a proxy in a
process of its own that forwards at a link's bandwidth, shared by every connection, and adds its latency each way."""

from __future__ import annotations

import time

import fsspec

from tests.helpers.object_stores import Link, LinkProcess


def test_the_modelled_link_takes_its_bandwidth_and_latency_and_keeps_the_bytes(s3_server, bucket):
    link = Link(mb_s=20, latency_ms=50)
    wire = LinkProcess(s3_server.target_port, link).start()
    try:
        shaped = fsspec.filesystem("s3", endpoint_url=wire.url, skip_instance_cache=True)
        direct = fsspec.filesystem("s3", endpoint_url=s3_server.target_url, skip_instance_cache=True)
        body = bytes(range(256)) * 8192  # 2 MiB: 105 ms on a 20 MB/s wire
        started = time.monotonic()
        shaped.call_s3("put_object", Bucket=bucket, Key="through-the-link", Body=body)
        took = time.monotonic() - started
        assert direct.cat_file(f"{bucket}/through-the-link") == body
        assert took >= len(body) / 20e6 + 2 * 0.05  # on the wire, then the answer's way back, at least
        started = time.monotonic()
        shaped.call_s3("head_object", Bucket=bucket, Key="through-the-link")
        assert time.monotonic() - started >= 2 * 0.05  # a small request pays the round trip
    finally:
        wire.stop()
