"""`specctl serve --record DIR`: rotating gzip JSONL, bounded disk use, atomic finalisation."""

import gzip
import json

import pytest

from specctl.controller import wire
from specctl.controller.recorder import Recorder
from specctl.training.readers import FileReport, expand_inputs, read_file


def frame(i, bs=16):
    return wire.encode_step_fields(server="sglang-0", rank=0, iter=i, ts=1_764_441_600.0 + i / 100,
                                   batch_size=bs, steps=3, topk=1, draft_tokens=4,
                                   accepted=[(i + k) % 4 for k in range(bs)], step_ms=10.0 + i % 7)


class Clock:
    def __init__(self):
        self.t = 1_764_441_600.0

    def __call__(self):
        return self.t


def lines_of(paths):
    out = []
    for p in paths:
        out += gzip.decompress(p.read_bytes()).splitlines()
    return out


def test_frames_round_trip_through_finalised_files(tmp_path):
    rec = Recorder(tmp_path, max_bytes=1 << 20, rotate_bytes=1 << 16, clock=Clock())
    frames = [frame(i) for i in range(500)]
    for f in frames:
        rec.write(f)
    assert not rec.files()  # still being written: nothing final yet
    assert [p.name.endswith(".jsonl.gz.part") for p in tmp_path.iterdir()] == [True]
    rec.close()
    files = rec.files()
    assert files and all(p.name.endswith(".jsonl.gz") for p in tmp_path.iterdir())
    assert lines_of(files) == frames
    assert all(isinstance(wire.decode(x), wire.StepRecord) for x in lines_of(files))


def test_rotation_and_bounded_disk_use_oldest_deleted_first(tmp_path):
    max_bytes, rotate = 64 * 1024, 8 * 1024
    rec = Recorder(tmp_path, max_bytes=max_bytes, rotate_bytes=rotate, clock=Clock())
    peak = 0
    for i in range(6000):
        rec.write(frame(i))
        if i % 50 == 0:
            peak = max(peak, rec.disk_bytes())
    rec.close()
    assert peak <= max_bytes and rec.disk_bytes() <= max_bytes
    assert rec.num_deleted > 0 and rec.num_written == 6000 and rec.num_dropped == 0
    files = rec.files()
    assert all(p.stat().st_size <= rotate for p in files)
    kept = [json.loads(x)["iter"] for x in lines_of(files)]
    # what survives is the newest stretch, contiguous and in order
    assert kept == list(range(6000 - len(kept), 6000))
    seqs = [int(p.name.split("-")[-1].split(".")[0]) for p in files]
    assert seqs == sorted(seqs)


def test_a_crashed_part_file_is_finalised_and_still_readable(tmp_path):
    clock = Clock()
    rec = Recorder(tmp_path, max_bytes=1 << 20, rotate_bytes=1 << 18, flush_s=1.0, clock=clock)
    for i in range(300):
        rec.write(frame(i))
        clock.t += 0.01  # sync-flushes once a virtual second
    # the daemon dies here: no close(); the .part file ends at the last sync-flush
    rec._raw.flush()
    part = next(tmp_path.iterdir())
    assert part.name.endswith(".part")
    rec2 = Recorder(tmp_path, max_bytes=1 << 20, rotate_bytes=1 << 18, clock=clock)
    recovered = rec2.files()
    assert len(recovered) == 1 and not recovered[0].name.endswith(".part")
    rep = FileReport(str(recovered[0]))
    samples = list(read_file(recovered[0], rep))
    assert rep.format == "telemetry"
    assert 200 <= len(samples) < 300
    assert rep.problems and "truncated" in rep.problems[0]
    # and a new recorder continues with the next sequence number
    rec2.write(frame(1000))
    rec2.close()
    assert len(rec2.files()) == 2 and rec2.files()[0] == recovered[0]


def test_write_never_raises(tmp_path, monkeypatch):
    rec = Recorder(tmp_path, max_bytes=1 << 20, rotate_bytes=1 << 16, clock=Clock())
    rec.write(frame(0))
    rec.write(b'{"kind":"step",\n"schema":1}')  # would split into two lines
    rec.write(b"")
    assert rec.num_dropped == 2

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rec._gz, "write", boom)
    rec.write(frame(1))
    assert rec.num_dropped == 3 and "No space left" in rec.last_error
    rec.write(frame(2))  # a fresh file
    rec.close()
    rec.write(frame(3))  # after close: dropped, not raised
    assert rec.num_dropped == 4
    assert [json.loads(x)["iter"] for x in lines_of(rec.files())] == [0, 2]


def test_a_frame_larger_than_a_file_is_dropped(tmp_path):
    rec = Recorder(tmp_path, max_bytes=1 << 16, rotate_bytes=4096, clock=Clock())
    rec.write(frame(0, bs=4000))
    assert rec.num_dropped == 1 and rec.num_written == 0
    rec.close()


def test_bad_limits_are_refused(tmp_path):
    with pytest.raises(ValueError):
        Recorder(tmp_path, max_bytes=10_000, rotate_bytes=20_000)
    with pytest.raises(ValueError):
        Recorder(tmp_path, max_bytes=10_000, rotate_bytes=100)


def test_train_reads_a_recording_directory_but_not_files_being_written(tmp_path):
    rec = Recorder(tmp_path, max_bytes=1 << 20, rotate_bytes=8192, clock=Clock())
    for i in range(800):
        rec.write(frame(i))
    files, missing = expand_inputs([tmp_path])
    assert not missing and files == rec.files()
    assert all(not p.name.endswith(".part") for p in files)
    assert any(p.name.endswith(".part") for p in tmp_path.iterdir())
    rec.close()
