"""`elastic drain`: the operator tells a running job that a slice will go; it leaves the slice at a step boundary and
recomputes nothing. A job or slice it does not know, or a past deadline: one line, non-zero exit, the job unharmed."""

from __future__ import annotations

import json
import threading

import pytest
import ray

from elastic.cli import main

from .helpers import ledger_job

pytestmark = pytest.mark.integration

N = 24


@pytest.mark.timeout(120)
def test_elastic_drain_leaves_the_slice_and_refuses_what_it_cannot_take(ray_local, monkeypatch, capsys, tmp_path):
    outcome: dict[str, object] = {}
    other = tmp_path / "other-token"
    other.write_text("x")  # a credential for the unknown job (never on the command line)

    def operator() -> None:
        # refused first (the job unharmed), then taken: each a separate `elastic drain` as an operator runs it
        capsys.readouterr()  # the job's own log lines so far
        for name, argv in (
            ("unknown_job", ["drain", "--job", "no-such-job", "--slice", "1", "--token-file", str(other)]),
            ("unknown_slice", ["drain", "--job", "drain-cli", "--slice", "7"]),
            ("past", ["drain", "--job", "drain-cli", "--slice", "1", "--deadline=-5s"]),
            ("bad_deadline", ["drain", "--job", "drain-cli", "--slice", "1", "--deadline", "soon"]),
            (
                "taken",
                ["drain", "--job", "drain-cli", "--slice", "1", "--deadline", "2m", "--reason", "rack", "--json"],
            ),
        ):
            outcome[name] = main(argv)
            outcome[name + "_out"] = capsys.readouterr()

    def on_step(step, metrics, run):
        if step == 6 and "taken" not in outcome:
            monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
            caller = threading.Thread(target=operator)
            caller.start()
            caller.join(60)

    job, loop = ledger_job("drain-cli", on_step=on_step, num_steps=N)
    with job:
        result = job.run(loop)
    for name in ("unknown_job", "unknown_slice", "past", "bad_deadline"):
        err = outcome[name + "_out"].err  # type: ignore[union-attr]
        said = [line for line in err.splitlines() if line.startswith("elastic:")]  # not the job's own log lines
        assert outcome[name] != 0 and len(said) == 1 and said[0].startswith("elastic: error:"), (name, err)
        assert "Traceback" not in err, (name, err)
    assert "not running" in outcome["unknown_job_out"].err  # type: ignore[union-attr]
    assert "does not hold slice(s) 7" in outcome["unknown_slice_out"].err  # type: ignore[union-attr]
    assert "deadline has passed" in outcome["past_out"].err  # type: ignore[union-attr]
    assert outcome["taken"] == 0, outcome["taken_out"]
    taken = json.loads(outcome["taken_out"].out)  # type: ignore[union-attr]
    assert taken["slices"] == [1] and taken["leaving"] == [1] and 1 not in taken["active"], taken
    r = result.report
    assert (r.notices, r.planned_shrinks, r.recoveries, r.steps_recomputed) == (1, 1, 0, 0), r
    assert (r.duplicate_steps, r.skipped_steps, r.steps_committed, r.slices_final) == (0, 0, N, 3), r
    (detail,) = r.notice_details
    assert detail["source"] == "operator" and detail["reason"] == "rack" and detail["planned"] is True, detail
