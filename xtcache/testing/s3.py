"""An S3-compatible server on loopback (moto) for the tests that use object stores.

    with s3_server("bucket") as (options, fs):    # options: fsspec storage options for s3:// URLs
        fs.pipe("s3://bucket/a.jsonl", b"...")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def s3_server(*buckets: str) -> Iterator[tuple[dict, object]]:
    """A moto server on 127.0.0.1 with `buckets` created: (storage options, an s3fs filesystem)."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
        fs = S3FileSystem(**options)
        for bucket in buckets:
            fs.mkdir(bucket)
        yield options, fs
    finally:
        server.stop()
