"""Type stubs for kvbridge_shm (the compiled reader plus the ``parse_batch`` helper)."""

import os
from typing import Any, Iterator, Optional, Tuple, Union

LAYOUT_VERSION: int
"""The ring layout version this build reads (``shm/LAYOUT.md``)."""

class RingError(Exception):
    """Base class of every kvbridge_shm error."""

class Lapped(RingError):
    """The writer overwrote records this reader had not read; the reader moved to ``resume_at``."""

    missed: int
    """Records lost (``resume_at`` minus the record that was wanted)."""
    resume_at: int
    """The next record the reader returns (the oldest retained when the lap was seen)."""

class RingReset(RingError):
    """The ring file was re-created; the reader switched to it, at its oldest record."""

    new_ring_id: int
    resume_at: int

class WriterGone(RingError):
    """Nothing to read and the writer is gone. Reading on after it restarts returns ``resume_at``."""

    resume_at: int

class CorruptRecord(RingError):
    """Record ``seq`` failed its checksum (changed behind the writer's back) and was skipped."""

    seq: int
    resume_at: int

class RingTruncated(RingError):
    """The ring file was truncated under this reader (would have been SIGBUS); it reads nothing more."""

class SeekOutOfRange(RingError):
    """``seek(requested)`` outside ``[oldest, newest + 1]``."""

    requested: int
    oldest: int
    newest: int

class Record:
    """One batch: its ring metadata and the encoded ``KvEventBatch`` (validated copy)."""

    @property
    def sequence(self) -> int:
        """The batch's sequence number (``KvEventBatch.sequence_number``)."""
    @property
    def dp_rank(self) -> int:
        """DP rank of the engine publisher the batch came from."""
    @property
    def upstream_seq(self) -> int:
        """The engine's own sequence number of the batch."""
    @property
    def ingest_ns(self) -> int:
        """Ingest time, nanoseconds since the Unix epoch."""
    @property
    def flags(self) -> int:
        """Writer-defined flags."""
    @property
    def payload(self) -> bytes:
        """The encoded ``KvEventBatch``: the bytes a gRPC subscriber receives for ``sequence``."""
    def __len__(self) -> int: ...

class Reader:
    """A read-only reader of one ring file, starting at the oldest retained record.

    One reader per thread: a call while another thread is inside the same reader raises
    ``RuntimeError``.
    """

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        *,
        stale_after: float = 1.0,
        spin_us: int = 0,
    ) -> None:
        """Map ``path`` read-only. Raises ``FileNotFoundError``, ``PermissionError`` or
        ``RingError`` (not a ring, other layout version, inconsistent header).

        ``spin_us`` (0 to 1000, default 0): busy-poll that long, GIL released, before sleeping
        on the ring's futex. The default never spins (an idle reader costs no CPU)."""
    @property
    def position(self) -> int:
        """The sequence number the next read tries to return."""
    @property
    def ring_id(self) -> int:
        """The ring incarnation's random id."""
    @property
    def path(self) -> str:
        """The ring file."""
    def window(self) -> Tuple[int, int]:
        """``(oldest, newest)``; ``oldest == newest + 1`` when the ring is empty."""
    def seek(self, seq: int) -> None:
        """Make ``seq`` the next record; ``seq`` in ``[oldest, newest + 1]`` else ``SeekOutOfRange``."""
    def writer_alive(self) -> bool:
        """Whether the writer process is alive."""
    def next(self, timeout: Optional[float] = None) -> Optional[Record]:
        """The next record, waiting up to ``timeout`` seconds (``None``: no limit) with the GIL
        released; ``None`` if the timeout passed. Raises ``Lapped``, ``RingReset``,
        ``WriterGone`` or ``CorruptRecord`` (reader already at ``resume_at``)."""
    def poll(self) -> Optional[Record]:
        """Non-blocking ``next``."""
    def __iter__(self) -> Iterator[Record]: ...
    def __next__(self) -> Record: ...
    def __enter__(self) -> "Reader": ...
    def __exit__(self, *exc: Any) -> bool: ...

def parse_batch(record: Union[Record, bytes]) -> Any:
    """Decode into ``smg_grpc_proto.generated.common_pb2.KvEventBatch`` (needs smg-grpc-proto)."""
