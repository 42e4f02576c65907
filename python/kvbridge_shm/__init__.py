"""Read kvbridge's shared-memory ring of KV-cache event batches from Python.

kvbridge writes every engine KV-cache event batch, encoded as an SMG ``KvEventBatch`` protobuf
message, into a ring file in ``/dev/shm``. A process on the same host reads it here straight
from memory, microseconds after ingest, instead of opening a gRPC stream::

    import kvbridge_shm

    r = kvbridge_shm.Reader("/dev/shm/kvbridge.ring")
    oldest, newest = r.window()
    r.seek(newest + 1)                 # only new batches
    for rec in r:                      # waits (GIL released) for each record
        handle(rec.sequence, rec.payload)

The reader is the Rust crate ``kvbridge-shm``'s ``RingReader`` (this package adds no second
implementation of the ring protocol, ``shm/LAYOUT.md``). It maps the ring read-only: it cannot
disturb the writer or other readers. Losing records is never silent: a reader the writer lapped
gets :class:`Lapped`, a re-created ring :class:`RingReset`, a dead writer :class:`WriterGone`,
each carrying ``resume_at``, where the reader is already positioned to go on.
"""

from ._native import (  # noqa: F401
    LAYOUT_VERSION,
    CorruptRecord,
    Lapped,
    Reader,
    Record,
    RingError,
    RingReset,
    RingTruncated,
    SeekOutOfRange,
    WriterGone,
)

__all__ = [
    "LAYOUT_VERSION",
    "CorruptRecord",
    "Lapped",
    "Reader",
    "Record",
    "RingError",
    "RingReset",
    "RingTruncated",
    "SeekOutOfRange",
    "WriterGone",
    "parse_batch",
]


def parse_batch(record):
    """Decode a :class:`Record` (or its ``payload`` bytes) into an SMG ``KvEventBatch``.

    Uses the message class of the published ``smg-grpc-proto`` package
    (``pip install smg-grpc-proto`` or ``pip install ./python[proto]``); it is imported only
    when this helper is called, so the reader itself needs no protobuf runtime.
    """
    try:
        from smg_grpc_proto.generated.common_pb2 import KvEventBatch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvbridge_shm.parse_batch needs the smg-grpc-proto package "
            "(pip install smg-grpc-proto)"
        ) from e
    payload = record.payload if isinstance(record, Record) else record
    return KvEventBatch.FromString(bytes(payload))
