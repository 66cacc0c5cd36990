"""Read and analyse CUDA caching-allocator memory snapshots.

``torch.cuda.memory._dump_snapshot(path)`` pickles the dict that
``torch.cuda.memory._snapshot()`` returns. This module reads that dict (pure Python, no
GPU, no torch import) and answers three questions about it: how many bytes each stream
holds, which stream's memory can no longer be reused, and which lines of *your* code
allocated what is still alive. Two snapshots taken a step apart are compared with
:func:`diff`.

The format, as the allocator writes it (fields this module does not read are left out):

- ``snap["segments"]``: one dict per ``cudaMalloc``'d segment with ``device``,
  ``address``, ``total_size`` (the reserved bytes), ``stream`` (the ``cudaStream_t`` as
  an int; ``0`` is the default stream), ``segment_type``, ``segment_pool_id``,
  ``allocated_size``, ``active_size``, ``requested_size``, ``is_expandable``, ``frames``
  and ``blocks``. The blocks tile the segment in address order.
- each block: ``address``, ``size`` (bytes after rounding), ``requested_size``, ``state``
  and ``frames``. ``state`` is ``"active_allocated"`` (a tensor uses it),
  ``"active_pending_free"`` (freed, waiting for another stream's work to finish; torch's
  docstring calls it ``"active_awaiting_free"``, both spellings are read) or
  ``"inactive"`` (cached, free for reuse by the same stream only).
- ``frames``: ``{"filename", "line", "name"}`` dicts, innermost call first; empty when
  history recording was off when the block was allocated.
- ``snap["device_traces"][device]``: the recorded allocator events of that device, oldest
  first, each with ``action`` (``"alloc"``, ``"free_requested"``, ``"free_completed"``,
  ``"segment_alloc"``, ``"segment_free"``, ``"segment_map"``, ``"segment_unmap"``,
  ``"oom"``, ``"snapshot"``), ``addr``, ``size``, ``stream``, ``frames`` and ``time_us``.
  Present only while ``torch.cuda.memory._record_memory_history()`` is on, and a ring
  buffer of its ``max_entries``: it covers the most recent events only.

"Active" below means both active states (the bytes the allocator cannot hand out), which
is what the allocator's own per-segment ``active_size`` counts.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from leakfree._text import format_mib, format_table

__all__ = [
    "DEFAULT_SKIP",
    "NO_FRAMES",
    "NewBlock",
    "SiteDelta",
    "SiteTotal",
    "SnapshotDiff",
    "StreamDelta",
    "StreamUsage",
    "bytes_per_stream",
    "dead_streams",
    "diff",
    "format_diff",
    "format_report",
    "load",
    "main",
    "top_allocation_sites",
]

Snapshot = Mapping[str, Any]

DEFAULT_SKIP: tuple[str, ...] = ("torch/", "<frozen")
"""Frames whose filename contains one of these are not reported as allocation sites."""

NO_FRAMES = "<no frames>"
"""The site of blocks recorded without a stack (history recording was off)."""

_ACTIVE_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free"})
_MIB = 1024 * 1024


# --------------------------------------------------------------------------- loading


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain containers only: a snapshot never refers to a class or function,
    so a file that does is refused instead of running its code."""

    def find_class(self, module: str, name: str, /) -> Any:
        raise _Refused(
            f"it refers to {module}.{name}; a memory snapshot holds only plain containers"
        )


class _Refused(pickle.UnpicklingError):
    """A pickle refused for what it refers to (not for being garbage)."""


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Unpickle a snapshot written by ``torch.cuda.memory._dump_snapshot(path)``.

    Checks the shape this module relies on (a dict whose ``"segments"`` is a list of
    segment dicts with ``total_size`` and a ``blocks`` list of dicts with ``size`` and
    ``state``) and raises ``ValueError`` naming the file otherwise. A pickle that refers
    to any class or function is refused without being executed. A missing file raises
    the usual ``OSError``.
    """
    name = os.fspath(path)
    with open(name, "rb") as f:
        try:
            obj = _PlainUnpickler(f).load()
        except _Refused as e:
            raise ValueError(f"{name}: not a memory snapshot: {e}") from e
        except Exception as e:  # garbage input raises many different types
            # The unpickler's own words ("invalid literal for int()", "invalid load key")
            # describe the bytes it tripped on, not the mistake: say what the file is not.
            raise ValueError(
                f"{name}: not a memory snapshot: not a pickle file ({type(e).__name__}); "
                "write one with torch.cuda.memory._dump_snapshot(path)"
            ) from e
    problem = _shape_problem(obj)
    if problem is not None:
        raise ValueError(
            f"{name}: not a memory snapshot ({problem}); write one with "
            "torch.cuda.memory._dump_snapshot(path)"
        )
    return cast(dict[str, Any], obj)  # _shape_problem checked it is a dict


def _shape_problem(obj: object) -> str | None:
    if not isinstance(obj, dict):
        return f"the pickle holds a {type(obj).__name__}, not a dict"
    segments = obj.get("segments")
    if not isinstance(segments, list):
        return "no 'segments' list"
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or "total_size" not in seg:
            return f"segment {i} is not a dict with 'total_size'"
        blocks = seg.get("blocks", [])
        if not isinstance(blocks, list):
            return f"segment {i} has no 'blocks' list"
        for j, b in enumerate(blocks):
            if not isinstance(b, dict) or "size" not in b or "state" not in b:
                return f"block {j} of segment {i} is not a dict with 'size' and 'state'"
    traces = obj.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        return "'device_traces' is not a list of lists"
    return None


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class _Block:
    device: int
    stream: int
    address: int
    size: int
    state: str
    frames: Sequence[Mapping[str, Any]]

    @property
    def active(self) -> bool:
        return self.state in _ACTIVE_STATES


def _frames_of(block: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    frames = block.get("frames")
    if frames is None and block.get("history"):  # pre-2.1 snapshots
        frames = block["history"][0].get("frames")
    return frames or ()


def _blocks(snap: Snapshot) -> Iterator[_Block]:
    """Every block of every segment, with the address computed from the segment's when
    the block has none (older snapshots)."""
    for seg in snap["segments"]:
        device = int(seg.get("device", 0))
        stream = int(seg.get("stream", 0))
        address = int(seg.get("address", 0))
        for b in seg.get("blocks", ()):
            address = int(b.get("address", address))
            size = int(b["size"])
            yield _Block(device, stream, address, size, str(b["state"]), _frames_of(b))
            address += size


def _site(frames: Sequence[Mapping[str, Any]], skip: tuple[str, ...]) -> str:
    """``"filename:line:name"`` of the innermost frame not matching ``skip``; the innermost
    frame when all match; :data:`NO_FRAMES` when there are none."""
    if not frames:
        return NO_FRAMES
    chosen = frames[0]
    for frame in frames:
        if not any(s in str(frame.get("filename", "")) for s in skip):
            chosen = frame
            break
    return f"{chosen.get('filename', '?')}:{chosen.get('line', '?')}:{chosen.get('name', '?')}"


# --------------------------------------------------------------------------- streams


@dataclass
class StreamUsage:
    """What one stream of one device holds in the allocator's cache.

    ``reserved_bytes`` is the sum of its segments' ``total_size``; ``active_bytes`` and
    ``inactive_bytes`` sum its blocks by state (together they equal ``reserved_bytes``
    when the blocks tile the segments, as the allocator writes them). ``last_event_us``
    is the largest ``time_us`` among this stream's recorded trace events on this device,
    ``None`` without any.
    """

    stream: int
    device: int
    reserved_bytes: int
    active_bytes: int
    inactive_bytes: int
    segments: int
    last_event_us: float | None


def _traces(snap: Snapshot) -> list[list[Mapping[str, Any]]]:
    traces = snap.get("device_traces") or []
    return [list(t) for t in traces]


def _last_events(snap: Snapshot) -> dict[tuple[int, int], float]:
    last: dict[tuple[int, int], float] = {}
    for device, trace in enumerate(_traces(snap)):
        for e in trace:
            t = e.get("time_us")
            if t is None:
                continue
            key = (device, int(e.get("stream", 0)))
            last[key] = max(last.get(key, float(t)), float(t))
    return last


def _windows(snap: Snapshot) -> dict[int, tuple[float, float]]:
    """Per device, the (earliest, latest) ``time_us`` of its recorded trace events."""
    windows: dict[int, tuple[float, float]] = {}
    for device, trace in enumerate(_traces(snap)):
        times = [float(e["time_us"]) for e in trace if e.get("time_us") is not None]
        if times:
            windows[device] = (min(times), max(times))
    return windows


def bytes_per_stream(snap: Snapshot) -> list[StreamUsage]:
    """Reserved, active and inactive bytes and segment count per (device, stream).

    Only streams owning at least one segment are listed, sorted by active bytes
    (descending), then reserved bytes (descending), device and stream.
    """
    acc: dict[tuple[int, int], list[int]] = {}
    for seg in snap["segments"]:
        key = (int(seg.get("device", 0)), int(seg.get("stream", 0)))
        row = acc.setdefault(key, [0, 0, 0, 0])
        row[0] += int(seg["total_size"])
        row[3] += 1
    for b in _blocks(snap):
        row = acc[(b.device, b.stream)]
        row[1 if b.active else 2] += b.size
    last = _last_events(snap)
    usage = [
        StreamUsage(
            stream=stream,
            device=device,
            reserved_bytes=r[0],
            active_bytes=r[1],
            inactive_bytes=r[2],
            segments=r[3],
            last_event_us=last.get((device, stream)),
        )
        for (device, stream), r in acc.items()
    ]
    usage.sort(key=lambda u: (-u.active_bytes, -u.reserved_bytes, u.device, u.stream))
    return usage


def dead_streams(snap: Snapshot, alive: Iterable[int] | None = None) -> list[StreamUsage]:
    """Streams whose reserved memory nothing will use again, largest reservation first.

    The caching allocator binds every block to the stream it was allocated on and only
    hands a cached block out again to an allocation on that same stream. Memory cached by
    a side stream that is gone (an activation offloader's copy stream, a prefetcher's)
    is therefore lost to the rest of the program until ``torch.cuda.empty_cache()``.

    With ``alive`` (the ``cuda_stream`` ints of the streams still in use): every stream
    not in ``alive`` that holds reserved bytes. Stream 0, the default stream, always
    counts as alive.

    Without ``alive``, a heuristic. A stream is reported when all of these hold:

    1. it is not stream 0 and owns at least one segment;
    2. every one of its blocks is ``"inactive"`` (no tensor, no pending free);
    3. if its device has recorded trace events with ``time_us``: the stream has no
       event at or after the midpoint of that device's recorded window
       (``(earliest + latest) / 2`` over all streams' events), which includes having no
       event at all. Without such events (history not recorded, or a torch too old
       to record times) only 1 and 2 apply.

    Limits: the trace is a ring buffer, so "the window" is what it kept, not the run. A
    live side stream that was idle through the second half of the window (used only in
    the forward pass of a window that ends in backward, say) is reported, and without a
    trace any idle side stream is; record history over at least two steps, or pass
    ``alive``, to rule those out. A dead stream that still holds one live tensor (a leak
    of another kind) is not reported by the heuristic, but is with ``alive``.
    """
    usage = bytes_per_stream(snap)
    if alive is not None:
        keep = {int(s) for s in alive} | {0}
        found = [u for u in usage if u.stream not in keep and u.reserved_bytes > 0]
    else:
        windows = _windows(snap)
        found = []
        for u in usage:
            if u.stream == 0 or u.segments == 0 or u.active_bytes != 0:
                continue
            window = windows.get(u.device)
            if window is not None and u.last_event_us is not None:
                midpoint = (window[0] + window[1]) / 2
                if u.last_event_us >= midpoint:
                    continue
            found.append(u)
    found.sort(key=lambda u: (-u.reserved_bytes, u.device, u.stream))
    return found


# --------------------------------------------------------------------------- sites


@dataclass
class SiteTotal:
    """Active bytes (block sizes) and block count allocated from one source location, in
    a snapshot. (A live tensor's creation site is :class:`leakfree.diagnostics.sites.Site`.)"""

    site: str
    bytes: int
    blocks: int


def _site_totals(snap: Snapshot, skip: tuple[str, ...]) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    for b in _blocks(snap):
        if b.active:
            row = totals.setdefault(_site(b.frames, skip), [0, 0])
            row[0] += b.size
            row[1] += 1
    return totals


def top_allocation_sites(
    snap: Snapshot, n: int = 10, *, skip: tuple[str, ...] = DEFAULT_SKIP
) -> list[SiteTotal]:
    """The ``n`` source locations holding the most active bytes.

    Each active block is attributed to the innermost frame of its allocation stack whose
    filename contains none of the ``skip`` strings, as ``"filename:line:name"`` (to the
    innermost frame when every frame matches ``skip``); blocks recorded without frames
    are grouped as :data:`NO_FRAMES`. Sorted by bytes (descending), then site.
    """
    sites = [SiteTotal(s, r[0], r[1]) for s, r in _site_totals(snap, skip).items()]
    sites.sort(key=lambda s: (-s.bytes, s.site))
    return sites[: max(n, 0)]


# --------------------------------------------------------------------------- diff


@dataclass
class StreamDelta:
    """Active bytes of one (device, stream) in the two snapshots (0 where absent)."""

    stream: int
    device: int
    active_before: int
    active_after: int

    @property
    def delta(self) -> int:
        return self.active_after - self.active_before


@dataclass
class SiteDelta:
    """Active bytes and blocks attributed to one site in the two snapshots."""

    site: str
    bytes_before: int
    bytes_after: int
    blocks_before: int
    blocks_after: int

    @property
    def delta(self) -> int:
        return self.bytes_after - self.bytes_before


@dataclass
class NewBlock:
    """A block active in the later snapshot with no active block of the same (address,
    size) in the earlier one."""

    address: int
    size: int
    device: int
    stream: int
    state: str
    site: str


@dataclass
class SnapshotDiff:
    """What changed between two snapshots.

    ``streams``: every (device, stream) owning segments in either snapshot, by growth of
    active bytes (descending). ``sites``: sites whose active bytes changed, by growth
    (descending). ``new_blocks``: by size (descending).
    """

    active_before: int
    active_after: int
    streams: list[StreamDelta]
    sites: list[SiteDelta]
    new_blocks: list[NewBlock]

    @property
    def active_delta(self) -> int:
        return self.active_after - self.active_before

    @property
    def new_bytes(self) -> int:
        return sum(b.size for b in self.new_blocks)


def diff(
    before: Snapshot, after: Snapshot, *, skip: tuple[str, ...] = DEFAULT_SKIP
) -> SnapshotDiff:
    """Compare the active memory of two snapshots (``skip`` as in
    :func:`top_allocation_sites`)."""
    streams_before = {(u.device, u.stream): u.active_bytes for u in bytes_per_stream(before)}
    streams_after = {(u.device, u.stream): u.active_bytes for u in bytes_per_stream(after)}
    streams = []
    for device, stream in set(streams_before) | set(streams_after):
        key = (device, stream)
        streams.append(
            StreamDelta(stream, device, streams_before.get(key, 0), streams_after.get(key, 0))
        )
    streams.sort(key=lambda s: (-s.delta, s.device, s.stream))

    sites_before = _site_totals(before, skip)
    sites_after = _site_totals(after, skip)
    sites = []
    for name in set(sites_before) | set(sites_after):
        b, a = sites_before.get(name, [0, 0]), sites_after.get(name, [0, 0])
        if a[0] != b[0]:
            sites.append(SiteDelta(name, b[0], a[0], b[1], a[1]))
    sites.sort(key=lambda s: (-s.delta, s.site))

    old = {(b.address, b.size) for b in _blocks(before) if b.active}
    new_blocks = [
        NewBlock(b.address, b.size, b.device, b.stream, b.state, _site(b.frames, skip))
        for b in _blocks(after)
        if b.active and (b.address, b.size) not in old
    ]
    new_blocks.sort(key=lambda b: (-b.size, b.address))

    return SnapshotDiff(
        active_before=sum(streams_before.values()),
        active_after=sum(streams_after.values()),
        streams=streams,
        sites=sites,
        new_blocks=new_blocks,
    )


# --------------------------------------------------------------------------- text


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 0) -> list[str]:
    """The report's tables: indented, no rule, the last ``left`` columns left-aligned."""
    right = range(len(header) - left)
    return format_table(header, rows, right=right, indent="  ", rule=False).splitlines()


def _time(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f}"


def format_report(snap: Snapshot, *, n: int = 10) -> str:
    """A text report of one snapshot: totals, bytes per stream, dead-stream suspects
    (the :func:`dead_streams` heuristic) and the ``n`` top allocation sites; sizes in MiB
    with one decimal."""
    usage = bytes_per_stream(snap)
    reserved = sum(u.reserved_bytes for u in usage)
    active = sum(u.active_bytes for u in usage)
    inactive = sum(u.inactive_bytes for u in usage)
    devices = sorted({u.device for u in usage})
    lines = [
        f"Memory snapshot: {len(snap['segments'])} segments on {len(devices)} device(s); "
        f"reserved {format_mib(reserved)} MiB, active {format_mib(active)} MiB, "
        f"inactive {format_mib(inactive)} MiB"
    ]
    events = sum(len(t) for t in _traces(snap))
    windows = _windows(snap)
    if windows:
        lo = min(w[0] for w in windows.values())
        hi = max(w[1] for w in windows.values())
        lines.append(f"History: {events} trace events, time_us {lo:.0f} .. {hi:.0f}")
    elif events:
        lines.append(f"History: {events} trace events without times")
    else:
        lines.append("History: not recorded (torch.cuda.memory._record_memory_history())")

    lines += ["", "Streams (by active bytes):"]
    header = ["device", "stream", "reserved MiB", "active MiB", "inactive MiB", "segments"]
    rows = [
        [
            str(u.device),
            str(u.stream),
            format_mib(u.reserved_bytes),
            format_mib(u.active_bytes),
            format_mib(u.inactive_bytes),
            str(u.segments),
            _time(u.last_event_us),
        ]
        for u in usage
    ]
    lines += _table([*header, "last event us"], rows)

    dead = dead_streams(snap)
    lines.append("")
    if dead:
        lost = sum(u.reserved_bytes for u in dead)
        lines += [
            f"Dead-stream suspects: {len(dead)} side stream(s), {format_mib(lost)} MiB reserved "
            "that only they could reuse",
            "(heuristic: all blocks inactive, no event in the second half of the trace):",
        ]
        rows = [
            [
                str(u.device),
                str(u.stream),
                format_mib(u.reserved_bytes),
                str(u.segments),
                _time(u.last_event_us),
            ]
            for u in dead
        ]
        lines += _table(["device", "stream", "reserved MiB", "segments", "last event us"], rows)
    else:
        lines.append("Dead-stream suspects: none")

    sites = top_allocation_sites(snap, n)
    lines += ["", f"Top allocation sites (active blocks, top {n}):"]
    if sites:
        rows = [[format_mib(s.bytes), str(s.blocks), s.site] for s in sites]
        lines += _table(["active MiB", "blocks", "site"], rows, left=1)
    else:
        lines.append("  none")
    return "\n".join(lines)


def format_diff(d: SnapshotDiff, *, n: int = 10) -> str:
    """A text report of a :class:`SnapshotDiff`: total active bytes, per-stream change,
    the ``n`` fastest-growing sites and the ``n`` largest new blocks; MiB, one decimal."""
    lines = [
        f"Active: {format_mib(d.active_before)} MiB -> {format_mib(d.active_after)} MiB "
        f"({format_mib(d.active_delta, signed=True)} MiB)",
        "",
        "Streams (by growth):",
    ]
    rows = [
        [
            str(s.device),
            str(s.stream),
            format_mib(s.active_before),
            format_mib(s.active_after),
            format_mib(s.delta, signed=True),
        ]
        for s in d.streams
    ]
    lines += _table(["device", "stream", "before MiB", "after MiB", "change MiB"], rows)

    lines += ["", f"Allocation sites by growth (top {n}):"]
    if d.sites:
        rows = [
            [format_mib(s.delta, signed=True), f"{s.blocks_after - s.blocks_before:+d}", s.site]
            for s in d.sites[: max(n, 0)]
        ]
        lines += _table(["change MiB", "blocks", "site"], rows, left=1)
    else:
        lines.append("  no change")

    lines += [
        "",
        f"New active blocks: {len(d.new_blocks)}, {format_mib(d.new_bytes)} MiB "
        f"(largest {min(n, len(d.new_blocks))}):",
    ]
    if d.new_blocks:
        rows = [
            [f"0x{b.address:x}", format_mib(b.size), str(b.stream), b.site]
            for b in d.new_blocks[: max(n, 0)]
        ]
        lines += _table(["address", "MiB", "stream", "site"], rows, left=1)
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def main(paths: Sequence[str]) -> int:
    """``python -m leakfree snapshot FILE [FILE2]``: print :func:`format_report` of one
    snapshot, or :func:`format_diff` of FILE -> FILE2. Returns 0; 2 (message on stderr)
    when a file cannot be read as a snapshot or the number of paths is not 1 or 2."""
    if len(paths) not in (1, 2):
        print("usage: python -m leakfree snapshot FILE [FILE2]", file=sys.stderr)
        return 2
    try:
        snaps = [load(p) for p in paths]
    except (OSError, ValueError) as e:
        print(f"leakfree snapshot: {e}", file=sys.stderr)
        return 2
    if len(snaps) == 1:
        print(format_report(snaps[0]))
    else:
        print(format_diff(diff(snaps[0], snaps[1])))
    return 0
