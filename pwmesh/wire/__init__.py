"""The wire: frame layout, header, codec, message types and protocol version.

Logic never touches bytes: daemons hand ``Message`` objects to ``encode`` and get
them back from ``decode``, which validates everything first.
"""

from pwmesh.wire.codec import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    Envelope,
    Limits,
    decode,
    encode,
    pack_records,
    unpack_records,
)
from pwmesh.wire.messages import Message, Record, message_types

__all__ = [
    "DEFAULT_LIMITS",
    "PROTOCOL_VERSION",
    "Envelope",
    "Limits",
    "Message",
    "Record",
    "decode",
    "encode",
    "message_types",
    "pack_records",
    "unpack_records",
]
