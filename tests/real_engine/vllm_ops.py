"""Decodes engine-wire payloads with the real vLLM's own classes, in the real-engine venv
(scripts/vllm-engine-venv.sh), where `vllm.distributed.kv_events` is importable as it is.

stdin: one JSON object per line, {"payload": HEX}; stdout, one line per input line as soon as it
is read: {"events": [...]}, each event {"type": tag} plus, for BlockStored, `block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, `medium`, `group_idx`, `kv_cache_spec_kind`,
`kv_cache_spec_sliding_window`, `locality` and `ownership`, for BlockRemoved `block_hashes`,
`medium`, `group_idx`, `locality` and `ownership` (an optional field vLLM left unset is null),
hashes as unsigned 64-bit ints (a bin hash: its last 8 bytes, big-endian); or {"error": why} when
vLLM's decoder rejects the payload.

Run as a script it prints {"ready": true} first. Another script of this directory that imports it
(publish_shapes.py) answers the same protocol with `serve()` once its own work is done.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

decoder = msgspec.msgpack.Decoder(KVEventBatch)


def h(v):
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray)):
        return int.from_bytes(bytes(v)[-8:], "big")
    return v & 0xFFFF_FFFF_FFFF_FFFF


def event(e):
    if isinstance(e, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": [h(x) for x in e.block_hashes],
            "parent_block_hash": h(e.parent_block_hash),
            "token_ids": list(e.token_ids),
            "block_size": e.block_size,
            "medium": e.medium,
            "group_idx": e.group_idx,
            "kv_cache_spec_kind": e.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
            "locality": e.locality,
            "ownership": e.ownership,
        }
    if isinstance(e, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h(x) for x in e.block_hashes],
            "medium": e.medium,
            "group_idx": e.group_idx,
            "locality": e.locality,
            "ownership": e.ownership,
        }
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    return {"type": type(e).__name__}


def serve():
    """Answers one line per payload line on stdin, until stdin closes."""
    for line in sys.stdin:
        req = json.loads(line)
        try:
            b = decoder.decode(bytes.fromhex(req["payload"]))
        except msgspec.DecodeError as e:
            print(json.dumps({"error": str(e)}), flush=True)
            continue
        print(json.dumps({"events": [event(e) for e in b.events]}), flush=True)


if __name__ == "__main__":
    print(json.dumps({"ready": True}), flush=True)
    serve()
