#!/usr/bin/env python3
"""Regenerates tests/corpus/decode-malformed/ from the engine vectors plus hand-made hostile
inputs. Run from the repository root: python3 fuzz/gen_malformed_corpus.py"""
import json, os, pathlib, struct

root = pathlib.Path(__file__).resolve().parent.parent
out = root / "tests" / "corpus" / "decode-malformed"
out.mkdir(parents=True, exist_ok=True)
for f in out.glob("*.bin"):
    f.unlink()
vec = json.load(open(root / "tests" / "data" / "engine-vectors.json"))["vectors"]

def put(name, data):
    (out / f"{name}.bin").write_bytes(bytes(data))

# truncations of every vector at several points
for v in vec:
    p = bytes.fromhex(v["payload_hex"])
    tag = f'{v["release"]}-{v["case"]}'.replace(".", "_")
    for cut in sorted({1, len(p) // 3, len(p) // 2, len(p) - 1}):
        if 0 < cut < len(p):
            put(f"trunc-{tag}-{cut}", p[:cut])

def s(x):
    b = x.encode() if isinstance(x, str) else x
    return bytes([0xa0 | len(b)]) + b if len(b) < 32 else b"\xd9" + bytes([len(b)]) + b

TS = b"\xcb" + struct.pack(">d", 1700000000.5)
hdr = lambda n: b"\x93" + TS + bytes([0x90 | n])
# absurd lengths
put("huge-array32-events", b"\x93" + TS + b"\xdd\xff\xff\xff\xff" + b"\x00" * 80)
put("huge-array32-batch", b"\xdd\xff\xff\xff\xff" + b"\x00" * 90)
put("huge-map32-event", hdr(1) + b"\xdf\xff\xff\xff\xff" + b"\xc0" * 80 + b"\x00")
put("huge-str32-tag", hdr(1) + b"\x92\xdb\xff\xff\xff\xff" + b"a" * 70)
put("huge-bin32-hash", hdr(1) + b"\x92" + s("BlockRemoved") + b"\x91\xc6\xff\xff\xff\xf0" + b"\x01" * 50)
put("huge-tokens-array16", hdr(1) + b"\x95" + s("BlockStored") + b"\x91\x01\xc0\xdc\xff\xff\x01\x02")
put("huge-ext32", hdr(1) + b"\xc9\xff\xff\xff\xff\x01" + b"\x00" * 40)
put("huge-map16-batch", b"\xde\xff\xff" + b"\xc0" * 60)
# deep nesting
put("deep-arrays-1000", hdr(1) + b"\x91" * 1000 + b"\x00" + b"\x00")
put("deep-maps-500", hdr(1) + b"\x82" + s("type") + s("AllBlocksCleared") + s("x") + b"\x81\xa1k" * 500 + b"\x00" + b"\x00")
put("deep-extra-keys", hdr(1) + b"\x89" + s("BlockStored") + b"\x91\x01\xc0\x91\x01\x01\xc0\xc0\xc0" + b"\x91" * 40 + b"\x01" + b"\x00")
put("deep-batch", b"\x91" * 200)
# bad utf-8
put("utf8-medium", hdr(1) + b"\x87" + s("BlockStored") + b"\x91\x01\xc0\x91\x01\x01\xc0\xa2\xff\xfe" + b"\x00")
put("utf8-tag", hdr(1) + b"\x91\xa3\xff\xfe\xfd" + b"\x00")
put("utf8-map-key", hdr(1) + b"\x82" + s("type") + s("BlockRemoved") + b"\xa2\xc3\x28\x91\x01" + b"\x00")
put("utf8-extra-key", hdr(1) + b"\x89" + s("BlockStored") + b"\x91\x01\xc0\x91\x01\x01\xc0\xc0\xc0\x91\x91\xa2\xff\xff" + b"\x00")
put("utf8-overlong", hdr(1) + b"\x82" + s("type") + s("AllBlocksCleared") + s("ownership") + b"\xa2\xc0\x80" + b"\x00")
# wrong types
put("wrong-ts-str", b"\x93" + s("now") + b"\x90\x00")
put("wrong-events-map", b"\x93" + TS + b"\x80\x00")
put("wrong-batch-str", s("hello"))
put("wrong-batch-nil", b"\xc0")
put("wrong-hashes-str", hdr(1) + b"\x92" + s("BlockRemoved") + s("abc") + b"\x00")
put("wrong-hash-float", hdr(1) + b"\x92" + s("BlockRemoved") + b"\x91\xcb" + b"\x00" * 8 + b"\x00")
put("wrong-hash-empty-bin", hdr(1) + b"\x92" + s("BlockRemoved") + b"\x91\xc4\x00" + b"\x00")
put("wrong-token-negative", hdr(1) + b"\x95" + s("BlockStored") + b"\x91\x01\xc0\x91\xff\x01" + b"\x00")
put("wrong-token-u64", hdr(1) + b"\x95" + s("BlockStored") + b"\x91\x01\xc0\x91\xcf" + b"\xff" * 8 + b"\x01\x00")
put("wrong-block-size-neg", hdr(1) + b"\x95" + s("BlockStored") + b"\x91\x01\xc0\x91\x01\xd0\xff" + b"\x00")
put("wrong-block-size-huge", hdr(1) + b"\x95" + s("BlockStored") + b"\x91\x01\xc0\x91\x01\xcf" + b"\x7f" * 8 + b"\x00")
put("wrong-group-neg", hdr(1) + b"\x94" + s("BlockRemoved") + b"\x91\x01\xc0\xff" + b"\x00")
put("wrong-tag-int", hdr(1) + b"\x92\x05\x91\x01" + b"\x00")
put("wrong-ts-bool", b"\x92\xc3\x90")
put("wrong-all-nil-store", hdr(1) + b"\x9c" + s("BlockStored") + b"\xc0" * 11 + b"\x00")
put("reserved-marker", hdr(1) + b"\xc1" + b"\x00")
put("reserved-marker-batch", b"\xc1")
put("empty", b"")
put("batch-too-short", b"\x91" + TS)
put("map-batch-no-events", b"\x81" + s("ts") + TS)
put("map-batch-dup-ts", b"\x83" + s("ts") + TS + s("ts") + TS + s("events") + b"\x90")
put("ext-values", hdr(2) + b"\xd4\x01\x02" + b"\xc7\x03\x05abc" + b"\x00")
put("many-empty-events", b"\x93" + TS + b"\xdc\x10\x00" + b"\x90" * 4096 + b"\x00")
put("garbage-ff", b"\xff" * 64)
print(len(list(out.glob("*.bin"))), "files")
