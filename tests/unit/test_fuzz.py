"""What comes from outside, fuzzed (hypothesis): configuration, stream records, run records, keeper images and
CLI arguments each end in a clear error or a clean refusal, never a crash, a hang or silent acceptance."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.cli import main
from elastic.config import ElasticConfig, Policy
from elastic.errors import ConfigError
from elastic.snapshot.errors import SnapshotCorruptError
from elastic.snapshot.image import HostImage, LeafImage, Piece, checksum, meta_checksum
from elastic.snapshot.seal import seal, sealed
from elastic.supervision import events

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
KEY = "k" * 64
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(),
    st.lists(st.integers()),
    st.dictionaries(st.text(), st.integers()),
)


@FAST
@given(num_slices=anything, devices=anything, steps=anything, min_slices=anything)
def test_config_is_built_or_refused_with_a_config_error(num_slices, devices, steps, min_slices):
    try:
        ElasticConfig(
            simulated=True,
            num_slices=num_slices,
            devices_per_slice=devices,
            num_steps=steps,
            policy=Policy(min_slices=min_slices),
        )
    except ConfigError as err:
        assert str(err)


@FAST
@given(
    fields=st.dictionaries(st.text(min_size=1).filter(lambda k: k != "mac"), json_values, max_size=6), data=st.data()
)
def test_a_signed_record_verifies_and_any_change_does_not(fields, data):
    record = events.sign({"wall": 1.5, "writer": "supervisor", "seq": 3, "kind": "view", **fields}, KEY)
    record = json.loads(json.dumps(record))  # as stored
    good, bad = events.verify([record], KEY)
    assert good == [record] and not bad
    key = data.draw(st.sampled_from(sorted(record)))
    changed = {**record, key: data.draw(json_values.filter(lambda v: v != record[key]))}
    assert events.verify([changed], KEY)[1] == [changed]
    assert events.verify([record], "other")[1] == [record]


@FAST
@given(
    raw=st.binary(max_size=200)
    | st.text(max_size=200).map(str.encode)
    | json_values.map(lambda v: json.dumps(v).encode())
)
def test_a_stored_value_is_a_record_or_nothing(raw):
    record = events.parse(raw)
    assert record is None or (isinstance(record["wall"], (int, float)) and isinstance(record["seq"], int))
    assert events.verify([record] if record else [], KEY)[0] == []  # unsigned: never the job's


@FAST
@given(lines=st.lists(st.binary(max_size=80), max_size=5))
def test_a_damaged_run_record_is_a_config_error(tmp_path_factory, lines):
    where = tmp_path_factory.mktemp("run")
    (where / "events.jsonl").write_bytes(b"\n".join(lines))
    try:
        records, _ = events.load(where)
    except ConfigError as err:
        assert "events.jsonl" in str(err)
    else:
        assert all(events.parse(json.dumps(r)) == r for r in records)


def image(seed: int, pieces: int) -> HostImage:
    rng = np.random.default_rng(seed)
    data = [rng.normal(size=(4,)).astype(np.float32) for _ in range(pieces)]
    leaf = LeafImage(
        shape=(4 * pieces,),
        dtype="float32",
        pieces=tuple(Piece(index=((4 * i, 4 * i + 4),), data=d, checksum=checksum(d)) for i, d in enumerate(data)),
    )
    meta = {"step": seed, "ledger": np.arange(3)}
    return HostImage(step=seed, generation=1, leaves=(leaf,), meta=meta, meta_checksum=meta_checksum(meta))


@FAST
@given(seed=st.integers(0, 1000), pieces=st.integers(1, 4), data=st.data())
def test_an_altered_or_truncated_image_fails_its_seal_and_its_checksums(seed, pieces, data):
    good = seal(image(seed, pieces), KEY)
    assert sealed(good, KEY) and not sealed(good, "other") and not sealed(image(seed, pieces), KEY)
    i = data.draw(st.integers(0, pieces - 1))
    old = good.leaves[0].pieces[i]
    cut = data.draw(st.integers(0, old.data.size - 1))
    how = data.draw(st.sampled_from(["truncate", "flip", "recompute"]))
    if how == "truncate":
        new = dataclasses.replace(old, data=old.data[:cut])
    else:
        changed = old.data.copy()
        changed.view(np.uint8)[cut] ^= 0xFF
        new = dataclasses.replace(old, data=changed, checksum=checksum(changed) if how == "recompute" else old.checksum)
    pieces_ = list(good.leaves[0].pieces)
    pieces_[i] = new
    forged = dataclasses.replace(good, leaves=(dataclasses.replace(good.leaves[0], pieces=tuple(pieces_)),))
    assert not sealed(forged, KEY)
    if how != "recompute":
        with pytest.raises(SnapshotCorruptError):
            forged.verify()


WORDS = [
    "status",
    "events",
    "report",
    "inject",
    "kill",
    "silence",
    "--job",
    "--job-name",
    "--slice",
    "1",
    "-1",
    "x",
    "--json",
    "--run",
    "--dir",
    "/nonexistent",
    "--follow",
    "--follow-for",
    "0",
    "--kind",
    "view",
    "--token",
    "--token-file",
    "--yes",
    "-v",
    "--out",
    "",
    "nan",
    "--bogus",
]


@settings(max_examples=80, deadline=None)
@given(argv=st.lists(st.sampled_from(WORDS), max_size=7))
def test_cli_arguments_end_in_a_status_never_a_crash(argv):
    if "--dir" not in argv:
        argv = [*argv, "--dir", "/nonexistent"]
    saved = os.environ.pop("RAY_ADDRESS", None)  # nothing here may start or join a cluster
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse: usage errors and --help
        assert exit_.code in (0, 2)
    else:
        assert code in (0, 1, 2)
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
