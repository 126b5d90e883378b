"""Encoder for AWS event-stream frames (``application/vnd.amazon.eventstream``), as SageMaker sends them.

One frame: prelude (total length u32 BE, headers length u32 BE, CRC32 of those 8 bytes), headers,
payload, CRC32 of everything before it. Headers here are all strings (type 7). botocore only ships a
decoder (``botocore.eventstream.EventStreamBuffer``), which the tests use as the oracle.
"""

from __future__ import annotations

import json
import struct
import zlib

_STRING_HEADER = 7


def _crc(data: bytes) -> bytes:
    return struct.pack("!I", zlib.crc32(data) & 0xFFFFFFFF)


def encode_headers(headers: dict[str, str]) -> bytes:
    """Encode string headers: ``u8 name_len, name, u8 type=7, u16 value_len, value``."""
    out = bytearray()
    for name, value in headers.items():
        raw_name, raw_value = name.encode("utf-8"), value.encode("utf-8")
        out += struct.pack("!B", len(raw_name)) + raw_name
        out += struct.pack("!BH", _STRING_HEADER, len(raw_value)) + raw_value
    return bytes(out)


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    """Encode one event-stream message with both CRCs."""
    raw_headers = encode_headers(headers)
    total_length = 12 + len(raw_headers) + len(payload) + 4
    prelude = struct.pack("!II", total_length, len(raw_headers))
    message = prelude + _crc(prelude) + raw_headers + payload
    return message + _crc(message)


def payload_part(data: bytes) -> bytes:
    """A ``PayloadPart`` event carrying raw model output bytes."""
    headers = {
        ":event-type": "PayloadPart",
        ":content-type": "application/octet-stream",
        ":message-type": "event",
    }
    return encode_message(headers, data)


def model_stream_error(message: str, error_code: str = "StreamBroken") -> bytes:
    """A ``ModelStreamError`` exception event (codes: StreamBroken, ModelInvocationTimeExceeded)."""
    headers = {
        ":exception-type": "ModelStreamError",
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_message(headers, json.dumps({"Message": message, "ErrorCode": error_code}).encode())


def internal_stream_failure(message: str) -> bytes:
    """An ``InternalStreamFailure`` exception event."""
    headers = {
        ":exception-type": "InternalStreamFailure",
        ":content-type": "application/json",
        ":message-type": "exception",
    }
    return encode_message(headers, json.dumps({"Message": message}).encode())
