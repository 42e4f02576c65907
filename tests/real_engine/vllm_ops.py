"""Decodes engine-wire payloads with the real vLLM's own classes, in the real-engine venv
(scripts/vllm-engine-venv.sh), where `vllm.distributed.kv_events` is importable as it is.

stdin: one JSON object per line, {"payload": HEX}; stdout, one line per input line as soon as it
is read: {"events": [...]}, each event {"type": tag} plus, for BlockStored, `block_hashes`,
`parent_block_hash`, `token_ids`, `block_size`, `medium`, `group_idx` and `kv_cache_spec_kind`,
for BlockRemoved `block_hashes`, `medium` and `group_idx`, hashes as unsigned 64-bit ints (a bin
hash: its last 8 bytes, big-endian), a field the event leaves out as null; or {"error": why} when
vLLM's decoder rejects the payload.
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
        }
    if isinstance(e, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h(x) for x in e.block_hashes],
            "medium": e.medium,
            "group_idx": e.group_idx,
        }
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    return {"type": type(e).__name__}


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    try:
        b = decoder.decode(bytes.fromhex(req["payload"]))
    except msgspec.DecodeError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        continue
    print(json.dumps({"events": [event(e) for e in b.events]}), flush=True)
