"""leakfree.diagnostics.snapshot on hand-built snapshots in the allocator's pickle format.

The fixture below is what ``torch.cuda.memory._dump_snapshot`` writes, field for field
(``segments`` with their ``blocks``, ``device_traces`` with ``time_us``), for one device:

- stream 0: segment A (20 MiB: 8 MiB allocated, 4 MiB pending free, 8 MiB inactive) and
  segment B (2 MiB: 1 MiB allocated without frames, 0.5 MiB allocated, 0.5 MiB inactive);
- stream SIDE (an offloader's stream, last event at 2600 us): segment C, 10 MiB inactive;
- stream LIVE (idle now, but its last event is at 4100 us): segment D, 4 MiB inactive.

The trace spans 1000 .. 5000 us, so its midpoint is 3000 us.
"""

from __future__ import annotations

import collections
import copy
import pickle
from pathlib import Path
from typing import Any

import pytest

from leakfree.diagnostics.snapshot import (
    NO_FRAMES,
    SiteTotal,
    StreamUsage,
    bytes_per_stream,
    dead_streams,
    diff,
    format_diff,
    format_report,
    load,
    main,
    top_allocation_sites,
)

MiB = 1024 * 1024
KiB = 1024
SIDE = 94_000_000_000
LIVE = 94_000_001_000
A = 0x7F00_0000_0000
B = A + 32 * MiB
C = A + 64 * MiB
D = A + 96 * MiB
E = A + 128 * MiB


def frame(filename: str, line: int, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


LINEAR = frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 125, "forward")
STEP = frame("train.py", 42, "step")
MODEL = frame("model.py", 10, "forward")
PACK = frame("offload.py", 77, "pack")
LEAK = frame("train.py", 50, "leak")


def block(address: int, size: int, state: str, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "address": address,
        "size": size,
        "requested_size": size,
        "state": state,
        "frames": frames,
    }


def segment(address: int, stream: int, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(b["size"] for b in blocks)
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {
        "device": 0,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": allocated,
        "stream": stream,
        "segment_type": "large" if total > 2 * MiB else "small",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def event(action: str, addr: int, size: int, stream: int, t: int) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": t}


def make_snapshot() -> dict[str, Any]:
    return {
        "segments": [
            segment(
                A,
                0,
                [
                    block(A, 8 * MiB, "active_allocated", [LINEAR, STEP]),
                    block(A + 8 * MiB, 4 * MiB, "active_pending_free", [MODEL]),
                    block(A + 12 * MiB, 8 * MiB, "inactive", []),
                ],
            ),
            segment(
                B,
                0,
                [
                    block(B, 1 * MiB, "active_allocated", []),
                    block(B + MiB, 512 * KiB, "active_allocated", [STEP]),
                    block(B + MiB + 512 * KiB, 512 * KiB, "inactive", []),
                ],
            ),
            segment(
                C,
                SIDE,
                [
                    block(C, 6 * MiB, "inactive", [PACK]),
                    block(C + 6 * MiB, 4 * MiB, "inactive", []),
                ],
            ),
            segment(D, LIVE, [block(D, 4 * MiB, "inactive", [])]),
        ],
        "device_traces": [
            [
                event("segment_alloc", C, 10 * MiB, SIDE, 1000),
                event("alloc", C, 6 * MiB, SIDE, 1100),
                event("alloc", A, 8 * MiB, 0, 2000),
                event("free_requested", C, 6 * MiB, SIDE, 2500),
                event("free_completed", C, 6 * MiB, SIDE, 2600),
                event("alloc", D, 4 * MiB, LIVE, 4000),
                event("free_requested", D, 4 * MiB, LIVE, 4100),
                event("alloc", B, 512 * KiB, 0, 5000),
            ]
        ],
    }


def make_after() -> dict[str, Any]:
    """One step later: 6 MiB allocated from the inactive tail of A (train.py:50), the
    frameless 1 MiB block in B freed, a new 2 MiB segment E on SIDE."""
    snap = make_snapshot()
    seg_a = snap["segments"][0]
    seg_a["blocks"][2:] = [
        block(A + 12 * MiB, 6 * MiB, "active_allocated", [LINEAR, LEAK]),
        block(A + 18 * MiB, 2 * MiB, "inactive", []),
    ]
    snap["segments"][1]["blocks"][0]["state"] = "inactive"
    snap["segments"].append(segment(E, SIDE, [block(E, 2 * MiB, "active_allocated", [PACK])]))
    snap["device_traces"][0].append(event("alloc", E, 2 * MiB, SIDE, 6000))
    return snap


def write(path: Path, obj: object) -> Path:
    path.write_bytes(pickle.dumps(obj))
    return path


# --------------------------------------------------------------------------- streams


def test_bytes_per_stream_matches_hand_count() -> None:
    usage = bytes_per_stream(make_snapshot())
    assert usage == [
        StreamUsage(
            stream=0,
            device=0,
            reserved_bytes=22 * MiB,
            active_bytes=13 * MiB + 512 * KiB,  # 8 + 4 (pending free) + 1 + 0.5
            inactive_bytes=8 * MiB + 512 * KiB,
            segments=2,
            last_event_us=5000.0,
        ),
        StreamUsage(SIDE, 0, 10 * MiB, 0, 10 * MiB, 1, 2600.0),
        StreamUsage(LIVE, 0, 4 * MiB, 0, 4 * MiB, 1, 4100.0),
    ]
    for u in usage:
        assert u.active_bytes + u.inactive_bytes == u.reserved_bytes


def test_bytes_per_stream_without_traces_and_on_two_devices() -> None:
    snap = make_snapshot()
    del snap["device_traces"]
    snap["segments"][3]["device"] = 1
    usage = {(u.device, u.stream): u for u in bytes_per_stream(snap)}
    assert set(usage) == {(0, 0), (0, SIDE), (1, LIVE)}
    assert all(u.last_event_us is None for u in usage.values())
    assert usage[(1, LIVE)].reserved_bytes == 4 * MiB


# --------------------------------------------------------------------------- dead streams


def test_dead_streams_heuristic_reports_only_the_stale_side_stream() -> None:
    # SIDE: all inactive, last event 2600 < midpoint 3000. LIVE: all inactive but used at
    # 4100 >= 3000 (the negative case). Stream 0: default stream, never reported.
    assert [u.stream for u in dead_streams(make_snapshot())] == [SIDE]


def test_dead_streams_heuristic_needs_all_blocks_inactive() -> None:
    snap = make_snapshot()
    snap["segments"][2]["blocks"][0]["state"] = "active_allocated"
    assert dead_streams(snap) == []
    snap["segments"][2]["blocks"][0]["state"] = "active_pending_free"
    assert dead_streams(snap) == []


def test_dead_streams_heuristic_midpoint_boundary_and_missing_events() -> None:
    snap = make_snapshot()
    trace = snap["device_traces"][0]
    trace.append(event("free_completed", C, 6 * MiB, SIDE, 3000))  # at the midpoint
    # the window is still 1000 .. 5000: an event at the midpoint counts as recent
    assert dead_streams(snap) == []
    # no event at all for LIVE while the trace has others': reported too
    snap = make_snapshot()
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if e["stream"] != LIVE]
    assert [u.stream for u in dead_streams(snap)] == [SIDE, LIVE]  # by reserved bytes


def test_dead_streams_without_history_uses_segment_state_only() -> None:
    snap = make_snapshot()
    snap["device_traces"] = []
    assert [u.stream for u in dead_streams(snap)] == [SIDE, LIVE]
    snap = make_snapshot()
    for e in snap["device_traces"][0]:
        del e["time_us"]  # a torch too old to record times
    assert [u.stream for u in dead_streams(snap)] == [SIDE, LIVE]


def test_dead_streams_with_alive() -> None:
    snap = make_snapshot()
    assert [u.stream for u in dead_streams(snap, alive=[LIVE])] == [SIDE]
    assert [u.stream for u in dead_streams(snap, alive=iter([SIDE]))] == [LIVE]
    assert [u.stream for u in dead_streams(snap, alive=[SIDE, LIVE])] == []
    # stream 0 is always alive; order is by reserved bytes
    assert [u.stream for u in dead_streams(snap, alive=[])] == [SIDE, LIVE]
    # with alive, a dead stream holding live tensors is reported as well
    snap["segments"][2]["blocks"][0]["state"] = "active_allocated"
    dead = dead_streams(snap, alive=[LIVE])
    assert [(u.stream, u.reserved_bytes, u.active_bytes) for u in dead] == [
        (SIDE, 10 * MiB, 6 * MiB)
    ]


# --------------------------------------------------------------------------- sites


def test_top_allocation_sites_skips_torch_frames() -> None:
    sites = top_allocation_sites(make_snapshot())
    assert sites == [
        SiteTotal("train.py:42:step", 8 * MiB + 512 * KiB, 2),
        SiteTotal("model.py:10:forward", 4 * MiB, 1),  # pending free is still active
        SiteTotal(NO_FRAMES, 1 * MiB, 1),
    ]
    assert top_allocation_sites(make_snapshot(), 1) == sites[:1]
    assert top_allocation_sites(make_snapshot(), 0) == []


def test_top_allocation_sites_custom_skip_and_all_skipped() -> None:
    snap = make_snapshot()
    sites = {s.site: (s.bytes, s.blocks) for s in top_allocation_sites(snap, skip=())}
    assert sites[f"{LINEAR['filename']}:125:forward"] == (8 * MiB, 1)
    assert sites["train.py:42:step"] == (512 * KiB, 1)
    # every frame skipped: the innermost frame is reported
    snap["segments"][1]["blocks"][1]["frames"] = [LINEAR]
    names = [s.site for s in top_allocation_sites(snap)]
    assert f"{LINEAR['filename']}:125:forward" in names


# --------------------------------------------------------------------------- diff


def test_diff_matches_hand_count() -> None:
    d = diff(make_snapshot(), make_after())
    assert (d.active_before, d.active_after) == (13 * MiB + 512 * KiB, 20 * MiB + 512 * KiB)
    assert d.active_delta == 7 * MiB  # +6 leak, +2 side stream, -1 freed
    assert [(s.stream, s.active_before, s.active_after, s.delta) for s in d.streams] == [
        (0, 13 * MiB + 512 * KiB, 18 * MiB + 512 * KiB, 5 * MiB),
        (SIDE, 0, 2 * MiB, 2 * MiB),
        (LIVE, 0, 0, 0),
    ]
    assert [(s.site, s.delta, s.blocks_before, s.blocks_after) for s in d.sites] == [
        ("train.py:50:leak", 6 * MiB, 0, 1),
        ("offload.py:77:pack", 2 * MiB, 0, 1),
        (NO_FRAMES, -1 * MiB, 1, 0),
    ]
    assert [(b.address, b.size, b.stream, b.site) for b in d.new_blocks] == [
        (A + 12 * MiB, 6 * MiB, 0, "train.py:50:leak"),
        (E, 2 * MiB, SIDE, "offload.py:77:pack"),
    ]
    assert d.new_bytes == 8 * MiB


def test_diff_matches_blocks_by_address_and_size() -> None:
    same = diff(make_snapshot(), make_snapshot())
    assert same.active_delta == 0 and same.sites == [] and same.new_blocks == []
    after = make_snapshot()
    after["segments"][0]["blocks"][0]["size"] = 7 * MiB  # same address, other size
    after["segments"][0]["blocks"][2]["size"] = 9 * MiB
    assert [(b.address, b.size) for b in diff(make_snapshot(), after).new_blocks] == [(A, 7 * MiB)]


def test_diff_computes_block_addresses_when_missing() -> None:
    before, after = make_snapshot(), make_after()
    for snap in (before, after):
        for seg in snap["segments"]:
            for b in seg["blocks"]:
                del b["address"]
    assert [b.address for b in diff(before, after).new_blocks] == [A + 12 * MiB, E]


# --------------------------------------------------------------------------- text


def test_format_report_shows_the_numbers() -> None:
    text = format_report(make_snapshot())
    assert "4 segments on 1 device(s)" in text
    assert "reserved 36.0 MiB, active 13.5 MiB, inactive 22.5 MiB" in text
    assert "8 trace events, time_us 1000 .. 5000" in text
    streams = text.split("Streams (by active bytes):")[1].split("Dead-stream")[0]
    row0 = next(line for line in streams.splitlines() if line.split()[:2] == ["0", "0"])
    assert row0.split() == ["0", "0", "22.0", "13.5", "8.5", "2", "5000"]
    dead = text.split("Dead-stream suspects:")[1].split("Top allocation sites")[0]
    assert "1 side stream(s), 10.0 MiB reserved" in dead
    assert str(SIDE) in dead and str(LIVE) not in dead
    sites = text.split("Top allocation sites")[1]
    assert any(line.split() == ["8.5", "2", "train.py:42:step"] for line in sites.splitlines())
    assert "<no frames>" in sites


def test_format_report_without_history_or_suspects() -> None:
    snap = make_snapshot()
    snap["device_traces"] = []
    snap["segments"] = snap["segments"][:2]
    text = format_report(snap, n=1)
    assert "History: not recorded" in text
    assert "Dead-stream suspects: none" in text
    assert "train.py:42:step" in text and "model.py" not in text  # n=1


def test_format_diff_shows_the_numbers() -> None:
    text = format_diff(diff(make_snapshot(), make_after()), n=1)
    assert "Active: 13.5 MiB -> 20.5 MiB (+7.0 MiB)" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["0", "0", "13.5", "18.5", "+5.0"] in lines
    assert ["0", str(SIDE), "0.0", "2.0", "+2.0"] in lines
    assert ["+6.0", "+1", "train.py:50:leak"] in lines
    assert "offload.py:77:pack" not in text.split("New active blocks")[0]  # n=1
    assert "New active blocks: 2, 8.0 MiB (largest 1):" in text
    assert [f"0x{A + 12 * MiB:x}", "6.0", "0", "train.py:50:leak"] in lines


# --------------------------------------------------------------------------- load / main


def test_load_round_trip(tmp_path: Path) -> None:
    snap = make_snapshot()
    assert load(write(tmp_path / "s.pickle", snap)) == snap
    assert load(str(tmp_path / "s.pickle")) == snap


@pytest.mark.parametrize(
    ("obj", "why"),
    [
        ([{"total_size": 1}], "holds a list, not a dict"),
        ({"device_traces": []}, "no 'segments' list"),
        ({"segments": {}}, "no 'segments' list"),
        ({"segments": [{"blocks": []}]}, "segment 0 is not a dict with 'total_size'"),
        (
            {"segments": [{"total_size": 2, "blocks": [{"size": 2}]}]},
            "block 0 of segment 0 is not a dict with 'size' and 'state'",
        ),
        ({"segments": [], "device_traces": [{}]}, "'device_traces' is not a list of lists"),
    ],
)
def test_load_rejects_what_is_not_a_snapshot(tmp_path: Path, obj: object, why: str) -> None:
    path = write(tmp_path / "bad.pickle", obj)
    with pytest.raises(ValueError, match="not a memory snapshot") as info:
        load(path)
    assert str(path) in str(info.value) and why in str(info.value)


def test_load_rejects_garbage_and_globals(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pickle"
    for text in (b"this is not a pickle", b"Iteration,loss\n1,2.5\n", b"Lorem ipsum\n"):
        garbage.write_bytes(text)  # the last two read as pickle opcodes, up to an int()
        with pytest.raises(ValueError) as info:
            load(garbage)
        message = str(info.value)
        assert "garbage.pickle: not a memory snapshot: not a pickle file" in message
        assert "_dump_snapshot" in message and "literal" not in message, message
    # a pickle that names a class is refused before anything is imported or called
    ordered = write(tmp_path / "ordered.pickle", collections.OrderedDict(segments=[]))
    with pytest.raises(ValueError, match="collections.OrderedDict"):
        load(ordered)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.pickle")


def test_main_report_diff_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = write(tmp_path / "before.pickle", make_snapshot())
    after = write(tmp_path / "after.pickle", make_after())

    assert main([str(before)]) == 0
    out = capsys.readouterr().out
    assert "reserved 36.0 MiB, active 13.5 MiB" in out

    assert main([str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "(+7.0 MiB)" in out

    bad = write(tmp_path / "bad.pickle", [1, 2])
    assert main([str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "bad.pickle" in captured.err
    assert main([str(before), str(tmp_path / "missing.pickle")]) == 2
    assert "missing.pickle" in capsys.readouterr().err
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_functions_do_not_mutate_the_snapshot() -> None:
    snap = make_snapshot()
    pristine = copy.deepcopy(snap)
    format_report(snap)
    format_diff(diff(snap, make_after()))
    dead_streams(snap, alive=[LIVE])
    assert snap == pristine
