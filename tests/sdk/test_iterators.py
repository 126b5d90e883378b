"""LineIterator: reassembly at every split point, error events, unknown events, unterminated ends."""

from __future__ import annotations

import itertools

import pytest
from botocore.exceptions import EventStreamError

from sdk.iterators import InternalStreamFailure, LineIterator, LineTooLongError, ModelStreamError

RECORDS = [
    b'{"token": {"id": 304, "text": "Deep", "log_prob": -0.05}}',
    b'{"token": {"id": 11157, "text": " L\xc3\xa9arning", "log_prob": -1.28}}',
    b'{"token": {"id": 338, "text": " is", "log_prob": -0.007}, "generated_text": "Deep L\xc3\xa9arning is"}',
]
STREAM = b"".join(r + b"\n" for r in RECORDS)


def parts(*chunks: bytes) -> list[dict]:
    return [{"PayloadPart": {"Bytes": c}} for c in chunks]


def test_one_part_per_line() -> None:
    assert list(LineIterator(parts(*(r + b"\n" for r in RECORDS)))) == RECORDS


def test_split_at_every_byte_offset() -> None:
    for cut in range(len(STREAM) + 1):
        assert list(LineIterator(parts(STREAM[:cut], STREAM[cut:]))) == RECORDS, cut


def test_split_at_every_pair_of_offsets_in_first_record() -> None:
    first = RECORDS[0] + b"\n"
    for a, b in itertools.combinations(range(len(first) + 1), 2):
        events = parts(first[:a], first[a:b], first[b:] + RECORDS[1] + b"\n")
        assert list(LineIterator(events)) == RECORDS[:2], (a, b)


def test_one_byte_per_part() -> None:
    assert list(LineIterator(parts(*(bytes([c]) for c in STREAM)))) == RECORDS


def test_several_lines_in_one_part_and_empty_parts() -> None:
    assert list(LineIterator(parts(b"", STREAM, b""))) == RECORDS


def test_last_line_without_newline_is_returned_once_and_iteration_ends() -> None:
    data = STREAM[:-1]  # drop the final "\n"
    for cut in range(len(data) + 1):
        it = LineIterator(parts(data[:cut], data[cut:]))
        assert list(it) == RECORDS, cut
        with pytest.raises(StopIteration):
            next(it)  # stays exhausted: no infinite loop, no repeated tail


def test_blank_lines_are_kept_for_sse() -> None:
    sse = b"data: {\"a\": 1}\n\ndata: {\"a\": 2}\n\n"
    assert list(LineIterator(parts(sse[:7], sse[7:]))) == [b'data: {"a": 1}', b"", b'data: {"a": 2}', b""]


def test_raw_bytes_chunks_are_accepted() -> None:
    assert list(LineIterator([STREAM[:10], bytearray(STREAM[10:])])) == RECORDS


def test_unknown_events_are_skipped_not_type_errors() -> None:
    events = [{"SomethingNew": {"x": 1}}, *parts(STREAM[:5]), {"initial-response": {}}, 42, *parts(STREAM[5:])]
    assert list(LineIterator(events)) == RECORDS


def test_model_stream_error_event_after_lines() -> None:
    events = parts(STREAM[:20]) + [{"ModelStreamError": {"Message": "boom", "ErrorCode": "StreamBroken"}}]
    it = LineIterator(parts(RECORDS[0] + b"\n") + events)
    assert next(it) == RECORDS[0]
    with pytest.raises(ModelStreamError) as info:
        next(it)
    assert info.value.error_code == "StreamBroken" and info.value.message == "boom"


def test_internal_stream_failure_event() -> None:
    with pytest.raises(InternalStreamFailure, match="try again"):
        list(LineIterator([{"InternalStreamFailure": {"Message": "try again"}}]))


def _raising(events: list, error: Exception):
    yield from events
    raise error


@pytest.mark.parametrize("code, cls", [("ModelStreamError", ModelStreamError), ("InternalStreamFailure", InternalStreamFailure)])
def test_botocore_event_stream_error_is_typed(code: str, cls: type) -> None:
    error = EventStreamError({"Error": {"Code": code, "Message": "upstream died"}}, "InvokeEndpointWithResponseStream")
    it = LineIterator(_raising(parts(RECORDS[0] + b"\n" + b'{"tok'), error))
    assert next(it) == RECORDS[0]
    with pytest.raises(cls, match="upstream died") as info:
        next(it)
    assert info.value.__cause__ is error


def test_other_exceptions_propagate_unchanged() -> None:
    with pytest.raises(ConnectionResetError):
        list(LineIterator(_raising(parts(b"a"), ConnectionResetError("reset"))))


def test_never_prints(capsys: pytest.CaptureFixture[str]) -> None:
    list(LineIterator([{"Weird": 1}, *parts(STREAM)]))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_max_line_bytes() -> None:
    with pytest.raises(LineTooLongError):
        list(LineIterator(parts(b"x" * 10, b"x" * 10, b"x" * 10), max_line_bytes=15))
