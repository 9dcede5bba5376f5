"""Parse Criteo TSV text (Kaggle train/test, 1TB day_N) into arrays, vectorised per chunk.

One sample a line, tab-separated: label, 13 integer counts (may be negative or empty),
26 categorical features as hex strings (normally 8 digits; may be empty). Kaggle's test.txt
has no label column. Every line is checked for its field count and the shape of each field;
real files have rough edges this parser keeps right:
- a line with fewer fields than the format is refused: a missing middle field would shift
  every later column, and a label-only line is no sample. Files whose trailing empty fields
  were stripped are read with `pad_short_lines` (the label and the 13 counts must be there;
  the missing categories are padded as missing values);
- a last line without a newline: kept and reported, unless it is cut short (the file ends
  mid-line), which is refused like any short line;
- CRLF line endings (files that passed through Windows tools): read as LF;
- a count below `dense_floor` (Criteo's counts start at -3): refused naming the value, or
  clipped to the floor and counted with `clip_dense`, so one bad cell cannot flatten a
  file's dense features through the transform's minimum;
- malformed lines (blank, an empty or bad label, non-hex category, non-integer count, too
  many or too few fields): reported with file and line number, or dropped and counted when
  skipping is asked for.
Missing values become 0, as TorchRec's `BinaryCriteoUtils.tsv_to_npys` maps them.

Shapes: N = lines in the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharding.errors import UserError

INT_FEATURES = 13
CAT_FEATURES = 26
MAX_HEX_DIGITS = 8  # Criteo's categorical values are 32-bit hashes

# hex digit value per byte, -1 for anything else
_HEX_LUT = np.full(256, -1, dtype=np.int8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
_TAB, _NL, _MINUS, _ZERO = 9, 10, ord("-"), ord("0")
_MAX_SAFE_DIGITS = 18  # |value| < 10**18 cannot overflow int64; longer ones go the slow way
_PAD_HINT = "; files whose trailing empty fields were stripped are read with pad_short_lines=true"
CRITEO_DENSE_FLOOR = -3  # the lowest count in Criteo's Kaggle and 1TB data (one column only)


class BadInputError(UserError, ValueError):
    """An input file that cannot be read as Criteo TSV; the message names it."""


class MalformedLineError(BadInputError):
    """A line that is not Criteo TSV; the message names file and line."""


@dataclass
class LineRules:
    """What a line must be, and what to do with one that is not."""

    skip_bad_lines: bool = False  # drop and count malformed lines instead of stopping
    pad_short_lines: bool = False  # accept lines whose trailing categories were stripped
    dense_floor: int = CRITEO_DENSE_FLOOR  # the lowest valid count; <= 0 (missing is 0)
    clip_dense: bool = False  # clip counts below the floor to it (counted) instead of refusing


@dataclass
class ParsedChunk:
    labels_N: np.ndarray  # int32; -1 where the file has no label column
    ints_NI: np.ndarray  # int64 raw counts, 0 where missing
    cats_NC: np.ndarray  # int64 raw hex values, 0 where missing
    bad_lines: int  # lines dropped (only when skipping)
    first_bad: str = ""  # "<file>:<line>: <why>" of the first dropped line
    clipped_I: np.ndarray | None = None  # counts clipped to the floor, per column
    unterminated: bool = False  # the chunk's (so the file's) last line has no newline


def n_fields(has_label: bool) -> int:
    return INT_FEATURES + CAT_FEATURES + int(has_label)


def _field_spans(buf: np.ndarray, fields: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start and end byte offsets of every field, [N, fields]; missing fields are empty
    spans. Also each line's field count. `buf` ends with a newline."""
    is_sep = (buf == _TAB) | (buf == _NL)
    seps = np.flatnonzero(is_sep)
    line_of_sep = np.cumsum(buf[seps] == _NL) - (buf[seps] == _NL)  # newline closes its line
    n_lines = int(line_of_sep[-1]) + 1
    first_sep_of_line = np.searchsorted(line_of_sep, np.arange(n_lines))
    field_of_sep = np.arange(len(seps)) - first_sep_of_line[line_of_sep]
    counts_N = np.bincount(line_of_sep, minlength=n_lines)
    line_start = np.empty(n_lines, dtype=np.int64)
    line_start[0] = 0
    line_start[1:] = seps[buf[seps] == _NL][:-1] + 1
    ends = np.broadcast_to(line_start[:, None], (n_lines, fields)).copy()
    keep = field_of_sep < fields
    ends[line_of_sep[keep], field_of_sep[keep]] = seps[keep]
    starts = np.empty_like(ends)
    starts[:, 0] = line_start
    starts[:, 1:] = ends[:, :-1] + 1
    short = field_of_sep[buf[seps] == _NL] + 1 < fields  # lines with stripped trailing fields
    if short.any():  # their missing fields: empty spans at the line's end
        rows = np.flatnonzero(short)
        present = counts_N[rows]
        cols = np.arange(fields)[None, :]
        missing = cols >= present[:, None]
        line_end = ends[rows, present - 1]
        s, e = starts[rows], ends[rows]
        s[missing] = np.broadcast_to(line_end[:, None], missing.shape)[missing]
        e[missing] = s[missing]
        starts[rows], ends[rows] = s, e
    return starts, ends, counts_N


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """Bytes [..., width] from each span start (rows of a sliding window view, no index
    arithmetic); bytes past a span's end belong to whatever follows it."""
    padded = np.concatenate([buf, np.zeros(width, dtype=np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    return windows[starts]


def _parse_hex(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    lengths = ends - starts
    bad = (lengths > MAX_HEX_DIGITS).any(axis=-1)
    width = int(min(lengths.max(initial=0), MAX_HEX_DIGITS))
    if width == 0:
        return np.zeros(starts.shape, dtype=np.int64), bad
    digits = _HEX_LUT[_gather(buf, starts, width)]
    inside = np.arange(width) < np.minimum(lengths, MAX_HEX_DIGITS)[..., None]
    bad |= ((digits < 0) & inside).any(axis=(-1, -2))
    value = np.zeros(starts.shape, dtype=np.uint32)  # 8 hex digits fit 32 bits
    for k in range(width):
        step = value * np.uint32(16) + digits[..., k].astype(np.uint32)
        np.copyto(value, step, where=inside[..., k])
    return value.astype(np.int64), bad


def _parse_ints(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    lengths = ends - starts
    first = buf[np.minimum(starts, len(buf) - 1)]
    negative = (first == _MINUS) & (lengths > 0)
    d_starts, d_lengths = starts + negative, lengths - negative
    width = int(d_lengths.max(initial=0))
    value = np.zeros(starts.shape, dtype=np.int64)
    bad = ((d_lengths == 0) & negative).any(axis=-1)  # a lone "-"
    if width == 0:
        return value, bad
    safe_width = min(width, _MAX_SAFE_DIGITS)
    digits = _gather(buf, d_starts, safe_width).astype(np.int64) - _ZERO
    inside = np.arange(safe_width) < d_lengths[..., None]
    bad |= (((digits < 0) | (digits > 9)) & inside).any(axis=(-1, -2))
    for k in range(safe_width):
        value = np.where(inside[..., k], value * 10 + digits[..., k], value)
    value = np.where(negative, -value, value)
    for row, col in zip(*np.nonzero(d_lengths > _MAX_SAFE_DIGITS), strict=True):
        text = buf[starts[row, col] : ends[row, col]].tobytes()
        try:  # very long counts: exact, unless they do not fit int64
            v = int(text)
            if not -(2**63) <= v < 2**63:
                raise OverflowError
            value[row, col] = v
        except (ValueError, OverflowError):
            bad[row] = True
    return value, bad


def _labels(
    buf: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    blank: np.ndarray,
    reasons: list[tuple[np.ndarray, str]],
) -> np.ndarray:
    """The label column (first field) as 0/1; its faults appended to `reasons`."""
    lab_len = ends[:, 0] - starts[:, 0]
    lab = buf[np.minimum(starts[:, 0], len(buf) - 1)]
    ok = (lab_len == 1) & ((lab == ord("0")) | (lab == ord("1")))
    reasons.append(((lab_len == 0) & ~blank, "the label is empty"))
    reasons.append((~ok & (lab_len > 0), "label is not 0 or 1"))
    return np.where((lab_len == 1) & (lab == ord("1")), 1, 0).astype(np.int32)


def _below_floor(ints_I: np.ndarray, below_I: np.ndarray, floor: int) -> str:
    """Why a line whose counts go below `dense_floor` is refused, naming its first such count."""
    c = int(np.flatnonzero(below_I)[0])
    return (
        f"count I{c + 1} is {ints_I[c]}, below dense_floor={floor}; pass clip_dense=true "
        f"to clip such counts to the floor and count them, or a lower dense_floor if such "
        f"counts are real"
    )


def parse_lines(
    data: bytes, has_label: bool, path: str, first_line: int, rules: LineRules
) -> ParsedChunk:
    """Parse whole lines (the last may lack its newline). `first_line` is 1-based."""
    # One vectorized pass over the chunk's bytes (66 lines): each fault is a mask over the
    # lines, kept in order, so the first bad line's first reason is the one reported.
    if not data:
        empty = np.zeros((0, INT_FEATURES), dtype=np.int64)
        return ParsedChunk(
            np.zeros(0, np.int32),
            empty,
            np.zeros((0, CAT_FEATURES), np.int64),
            0,
            clipped_I=np.zeros(INT_FEATURES, np.int64),
        )
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
    unterminated = not data.endswith(b"\n")
    if unterminated:
        data += b"\n"
    buf = np.frombuffer(data, dtype=np.uint8)
    fields = n_fields(has_label)
    starts, ends, counts_N = _field_spans(buf, fields)
    n = len(counts_N)
    blank = (counts_N == 1) & (ends[:, 0] == starts[:, 0])
    least = fields - CAT_FEATURES if rules.pad_short_lines else fields
    short = (counts_N < least) & ~blank
    cut = np.zeros(n, dtype=bool)
    cut[-1] = unterminated and counts_N[-1] < fields and not blank[-1]  # even when padding
    reasons: list[tuple[np.ndarray, str]] = [
        (blank, "blank line"),
        (counts_N > fields, f"more than {fields} fields"),
        (cut, "the file ends in the middle of this line: it was cut short"),
        (
            short & ~cut,
            f"fewer than {least} fields: a missing field would shift the columns "
            f"after it{'' if rules.pad_short_lines else _PAD_HINT}",
        ),
    ]
    col = 1 if has_label else 0
    labels_N = _labels(buf, starts, ends, blank, reasons) if has_label else np.full(n, -1, np.int32)
    ints_NI, bad_int = _parse_ints(
        buf, starts[:, col : col + INT_FEATURES], ends[:, col : col + INT_FEATURES]
    )
    cats_NC, bad_hex = _parse_hex(
        buf, starts[:, col + INT_FEATURES :], ends[:, col + INT_FEATURES :]
    )
    reasons += [
        (bad_int, "a count is not an integer that fits int64"),
        (bad_hex, f"a category is not hex of at most {MAX_HEX_DIGITS} digits"),
    ]
    below_NI = ints_NI < rules.dense_floor
    if not rules.clip_dense:
        reasons.append((below_NI.any(axis=1) & ~bad_int, "below"))
    bad_N = np.zeros(n, dtype=bool)
    for mask, _ in reasons:
        bad_N |= mask
    clipped_I = (below_NI & ~bad_N[:, None]).sum(axis=0) if rules.clip_dense else None
    if rules.clip_dense:
        np.maximum(ints_NI, rules.dense_floor, out=ints_NI)
    result = ParsedChunk(
        labels_N, ints_NI, cats_NC, 0, clipped_I=clipped_I, unterminated=unterminated
    )
    if not bad_N.any():
        return result
    i = int(np.flatnonzero(bad_N)[0])
    why = next(reason for mask, reason in reasons if mask[i])
    if why == "below":
        why = _below_floor(ints_NI[i], below_NI[i], rules.dense_floor)
    line = data.split(b"\n", i + 1)[i]
    first_bad = f"{path}:{first_line + i}: malformed Criteo line ({why}): {line[:120]!r}"
    if not rules.skip_bad_lines:
        raise MalformedLineError(
            f"{first_bad}. Fix the file, or pass skip_bad_lines=true to skip and count such lines."
        )
    keep = ~bad_N
    result.labels_N, result.ints_NI, result.cats_NC = labels_N[keep], ints_NI[keep], cats_NC[keep]
    result.bad_lines, result.first_bad = int(bad_N.sum()), first_bad
    return result
