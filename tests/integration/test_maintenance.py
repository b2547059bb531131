"""A host maintenance event on the metadata server of slice 2's host is a notice: the job leaves slice 2 at a step
boundary and recomputes nothing. The metadata server is a local HTTP server (one path per slice's host)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import ray

from elastic.config import NoticeSources

from .helpers import ledger_job

pytestmark = pytest.mark.integration

N = 24


def metadata_server(event: threading.Event) -> ThreadingHTTPServer:
    """GCE's keys per host (``/s<slice>/instance/...``): slice 2's host announces maintenance once ``event`` is set."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            host, _, key = self.path.strip("/").partition("/")
            body = {
                "instance/maintenance-event": "TERMINATE_ON_HOST_MAINTENANCE"
                if event.is_set() and host == "s2"
                else "NONE",
                "instance/preempted": "FALSE",
            }.get(key)
            if body is None or self.headers.get("Metadata-Flavor") != "Google":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.timeout(120)
def test_a_maintenance_event_leaves_the_slice_on_that_host(ray_local):
    announced = threading.Event()
    server = metadata_server(announced)
    url = f"http://127.0.0.1:{server.server_address[1]}/s{{slice}}"
    sources = NoticeSources(metadata_url=url, metadata_poll_s=0.2, maintenance_deadline_s=60.0)

    def on_step(step, metrics, run):
        if step == 6 and not announced.is_set():
            announced.set()
            left = ray.get(job.group.supervisor.wait_for_epoch.remote(run.epoch, 20), timeout=40)
            assert 2 in left.leaving and 2 not in left.active, left

    job, loop = ledger_job("maintenance", on_step=on_step, num_steps=N, notices=sources)
    try:
        with job:
            result = job.run(loop)
    finally:
        server.shutdown()
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed) == (1, 1, 0, 0), r
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed, r.slices_final) == (0, 0, N, 3), r
    (detail,) = r.notice_details
    assert detail["source"] == "maintenance" and detail["slices"] == [2] and detail["planned"] is True, detail
    assert "TERMINATE_ON_HOST_MAINTENANCE" in detail["reason"] and detail["lead_s"] == pytest.approx(60.0, abs=1.0)
