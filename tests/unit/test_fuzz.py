"""What comes from outside, fuzzed (hypothesis): configuration, stream records, run records, keeper images and
CLI arguments each end in a clear error or a clean refusal, never a crash, a hang or silent acceptance."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic import cli
from elastic.cli import main
from elastic.config import ElasticConfig, Policy
from elastic.errors import ConfigError, ElasticError
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


small_ints = st.integers(-3, 12)


def _counts_ok(value: object) -> bool:
    """The documented range of num_slices, devices_per_slice, num_steps and min_slices: an int of at least 1."""
    return type(value) is int and value >= 1


@FAST
@given(
    num_slices=small_ints | anything,
    devices=small_ints | anything,
    steps=small_ints | anything,
    min_slices=small_ints | anything,
)
def test_config_is_built_valid_or_refused_naming_the_field(num_slices, devices, steps, min_slices):
    """A config that builds holds what was given, in range, and builds again from its own fields; a refusal is a
    ConfigError of one line that names the first field out of range (in the order they are checked)."""
    given = {"num_slices": num_slices, "devices_per_slice": devices, "num_steps": steps}
    first_bad = next(
        (name for name, value in [("min_slices", min_slices), *given.items()] if not _counts_ok(value)),
        "policy.min_slices" if _counts_ok(min_slices) and _counts_ok(num_slices) and min_slices > num_slices else None,
    )
    try:
        config = ElasticConfig(simulated=True, policy=Policy(min_slices=min_slices), **given)
    except ConfigError as err:
        message = str(err)
        assert first_bad is not None, f"a valid config refused: {given}, min_slices={min_slices!r}: {message}"
        assert message.startswith(f"{first_bad} must be" if first_bad != "policy.min_slices" else first_bad), (
            first_bad,
            message,
        )
        assert "\n" not in message
    else:
        assert first_bad is None, f"built although {first_bad} is out of range: {config}"
        assert {name: getattr(config, name) for name in given} == given and config.policy.min_slices == min_slices
        assert 1 <= config.policy.min_slices <= config.num_slices
        assert config.device_counts == tuple(n * devices for n in range(min_slices, num_slices + 1))
        assert dataclasses.replace(config) == config  # its own fields pass the checks again


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
# The offline commands, each with its options (those that take a value map to True): status, events and report
# read --dir /nonexistent (no cluster), plan computes.
COMMANDS = {
    "status": {"--job": True, "--run": True, "--json": False, "-v": False, "--token-file": True},
    "events": {"--job": True, "--run": True, "--json": False, "-v": False, "--kind": True, "--follow-for": True},
    "report": {"--job": True, "--run": True, "--json": False, "-v": False, "--out": True},
    "plan": {
        "--chips": True,
        "--slices": True,
        "--chips-per-slice": True,
        "--mtbf-hours-per-chip": True,
        "--step-seconds": True,
        "--snapshot-seconds": True,
        "--restart-seconds": True,
        "--seed": True,
        "--json": False,
    },
}
VALUES = ["1", "-1", "0", "2", "x", "", "nan", "inf", "-inf", "1e12", "/nonexistent", "view,health", "--json"]


@st.composite
def command_lines(draw) -> list[str]:
    """A command and a few of its options with odd values (or a bogus one): these get past the command word."""
    command = draw(st.sampled_from(sorted(COMMANDS)))
    argv = [command]
    for option in draw(st.lists(st.sampled_from([*COMMANDS[command], "--bogus"]), max_size=5)):
        argv.append(option)
        if COMMANDS[command].get(option):
            argv.append(draw(st.sampled_from(VALUES)))
    if command == "plan":
        argv += ["--horizon-failures", "100"]  # bounded: the default simulates 100,000 failures
    return argv


def _names_what_to_fix(message: str, argv: list[str]) -> bool:
    """The message names an option or the command (as ``--flag`` or ``field_name``), or a value given (as is, or
    quoted as argparse does)."""
    flags = {w for w in argv if w.startswith("-")} | {f for c in COMMANDS.values() for f in c} | {"--dir"}
    words = {w for w in argv if len(w) > 1 and not w.startswith("-")} | {repr(w) for w in argv} | flags
    words |= {f.lstrip("-").replace("-", "_") for f in flags if len(f) > 2} | {"command"}
    return any(w in message for w in words)


@settings(max_examples=120, deadline=None)
@given(argv=command_lines() | st.lists(st.sampled_from(WORDS), max_size=7))
def test_cli_arguments_end_in_a_result_or_a_clean_refusal_never_a_crash(argv):
    """0, or a clean refusal: exit 2 for a usage or configuration error, 1 for another of the project's errors
    (ElasticError), each one line on stderr naming what to fix; an unexpected exception (main's ``unexpected``
    path: the type's name and "run again with -v") or a traceback without -v is a crash."""
    if "--dir" not in argv:
        argv = [*argv, "--dir", "/nonexistent"]
    saved = os.environ.pop("RAY_ADDRESS", None)  # nothing here may start or join a cluster
    reported: list[tuple[BaseException, int, bool]] = []  # what reached main's error path
    real_fail = cli._fail

    def fail(err: BaseException, code: int, verbose: bool, *, unexpected: bool = False) -> int:
        reported.append((err, code, unexpected))
        return real_fail(err, code, verbose, unexpected=unexpected)

    err_out = io.StringIO()
    try:
        with mock.patch.object(cli, "_fail", fail), redirect_stderr(err_out), redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse: usage errors and --help
                code = exit_.code
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
    stderr = err_out.getvalue()
    case = f"elastic {' '.join(map(repr, argv))} -> {code}: {stderr[-600:]!r}"
    assert code in (0, 1, 2), case
    assert not [e for e, _, unexpected in reported if unexpected], case  # main's path for a crash
    assert "run again with -v for the traceback" not in stderr, case
    assert "-v" in argv or "Traceback" not in stderr, case
    if code == 0:
        assert not reported, case
        return
    for error, status, _ in reported:  # the project's own errors, each with its status
        assert isinstance(error, ElasticError), case
        assert status == (2 if isinstance(error, ConfigError) else 1), case
    errors = [line for line in stderr.splitlines() if line.startswith("elastic") and ": error: " in line]
    assert len(errors) == 1, case  # one line says what is wrong ...
    message = errors[0].split(": error: ", 1)[1]
    assert message.strip() and _names_what_to_fix(message, argv), case  # ... and what to fix
