"""Writes tests/data/new-shapes.json: event kinds and fields that engines publish (or have
proposed in an open pull request) after the releases of engine-vectors.json, each payload
encoded by msgspec from a class definition that follows its source, with the meaning kvbridge
must give it.

    python tests/data/new_shapes.py > tests/data/new-shapes.json

Run with the real-engine venv's python (scripts/vllm-engine-venv.sh): msgspec and vLLM. Where a released
engine's own classes can encode a shape (vLLM 0.32's, for open medium strings), they are used;
a vector whose class is written here from a release's own source (not importable in this venv) is
marked `"status": "release-source"`; every other vector is marked `"status": "open-pr-schema"` with its source: its class is written
here from that pull request's description, because no release has it yet. When a release
ships one of them, replace the vector with one encoded by that release's classes.
"""
import json
import sys
from typing import Any, Optional, Union

import msgspec

TS = 1767225600.25


def i64(h):
    return h - (1 << 64) if h >= 1 << 63 else h


# ---- vLLM, map events (vLLM >= 0.33 layout; 0.32 has the same classes) ----------------------


class Ev(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Ev):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    # vLLM #55488 (typed extra_keys): the schema version of the event.
    event_version: Optional[int] = None


class BlockRemoved(Ev):
    block_hashes: list[int]
    medium: Optional[str]
    group_idx: Optional[int] = None
    # vLLM #48933: physical copies left per hash, aligned with block_hashes.
    remaining_copy_counts: Optional[list[int]] = None


class BlockInactive(Ev):
    """vLLM #50732: the last request released the block; it is still cached."""

    block_hashes: list[int]
    medium: Optional[str]


# vLLM #55488's typed extra keys: a tagged union, one list per block.
class MultiModalKey(msgspec.Struct, tag=True):
    modality: str
    hash: str
    block_offset: int


class LoRAKey(msgspec.Struct, tag=True):
    name: str


class CacheSaltKey(msgspec.Struct, tag=True):
    salt: str


class PromptEmbedsKey(msgspec.Struct, tag=True):
    hash: bytes


class LegacyExtraKey(msgspec.Struct, tag=True):
    value: Any


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


# ---- SGLang and ROCm ATOM: array events -----------------------------------------------------


class SgStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SgRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None
    # SGLang #39620: why the blocks left the tier.
    reason: Optional[str] = None


class SgBigramStored(msgspec.Struct, omit_defaults=True, tag="BlockStored"):
    """SGLang 0.5.23's map `BlockStored` as `srt/mem_cache/events.py` enqueues it for an EAGLE
    radix cache (`is_bigram`, SGLang #39610): one event per page, `token_ids` the page's bigrams
    `(raw[j], raw[j + 1])`, `block_size` their count."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[Any]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class AtomStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """ROCm ATOM: the vLLM 0.10 array layout and one trailing element, `token_offset`."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    token_offset: int


class AtomStoredLong(msgspec.Struct, array_like=True, tag="BlockStored"):
    """The same trailing element after vLLM 0.2x's twelve-element array layout."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]]
    group_idx: Optional[int]
    kv_cache_spec_kind: Optional[str]
    kv_cache_spec_sliding_window: Optional[int]
    token_offset: int


H = [0x1111_2222_3333_4444, 0x9999_0000_AAAA_BBBB, 0x0123_4567_89AB_CDEF, 0xFEDC_BA98_7654_3210]
BS = 4


def toks(n, seed):
    return [(seed * 7 + i * 3) % 500 for i in range(n)]


def stored_exp(hashes, parent, tokens, bs, **kw):
    e = {
        "type": "BlockStored",
        "block_hashes_i64": [i64(h) for h in hashes],
        "parent_block_hash_i64": None if parent is None else i64(parent),
        "token_ids": tokens,
        "block_size": bs,
        "has_extra_keys": False,
    }
    e.update(kw)
    return e


def removed_exp(hashes, **kw):
    e = {"type": "BlockRemoved", "block_hashes_i64": [i64(h) for h in hashes]}
    e.update(kw)
    return e


def vec(case, source, status, batch, events, stats, **extra):
    v = {
        "case": case,
        "source": source,
        "status": status,
        "payload_hex": msgspec.msgpack.encode(batch).hex(),
        "expected": {"ts": TS, "dp_rank": batch.data_parallel_rank, "events": events, "stats": stats},
    }
    v.update(extra)
    return v


def main():
    out = []
    t = toks(2 * BS, 1)
    gpu = dict(lora_id=None, medium="GPU", lora_name=None)
    out.append(vec(
        "block_inactive_between_store_and_removal",
        "vllm-project/vllm#50732", "open-pr-schema",
        Batch(TS, [
            BlockStored(H[:2], None, t, BS, **gpu),
            BlockInactive([H[0]], "GPU"),
            BlockRemoved([H[1]], "GPU"),
        ], 0),
        [stored_exp(H[:2], None, t, BS, lora_id=None, medium="GPU", lora_name=None),
         removed_exp([H[1]], medium="GPU")],
        {"inactive_events": 1, "unknown_tags": 0, "unknown_keys": 0, "malformed_events": 0},
    ))
    typed = [
        [LoRAKey("adapter-a"), MultiModalKey("image", "mm-hash-1", 3), CacheSaltKey("salt")],
        [PromptEmbedsKey(b"\x01\x02\x03"), LegacyExtraKey(["mm-hash-2", 0])],
    ]
    out.append(vec(
        "typed_extra_keys_event_version_1",
        "vllm-project/vllm#55488", "open-pr-schema",
        Batch(TS, [BlockStored(H[:2], None, t, BS, extra_keys=typed, event_version=1, **gpu)], 0),
        [stored_exp(H[:2], None, t, BS, lora_id=None, medium="GPU", lora_name=None,
                    has_extra_keys=True)],
        {"unknown_keys": 0, "extra_key_shapes_skipped": 0, "malformed_events": 0},
        extra_keys=[
            [{"text": "adapter-a"}, {"multimodal": ["mm-hash-1", 3]}, {"text": "salt"}],
            [{"blob": "010203"}, {"multimodal": ["mm-hash-2", 0]}],
        ],
    ))
    out.append(vec(
        "event_version_newer_than_known",
        "vllm-project/vllm#55488", "open-pr-schema",
        Batch(TS, [BlockStored(H[:1], None, t[:BS], BS, event_version=2, **gpu)], 0),
        [stored_exp(H[:1], None, t[:BS], BS, lora_id=None, medium="GPU", lora_name=None)],
        {"unknown_keys": 1, "malformed_events": 0},
    ))
    out.append(vec(
        "removal_with_remaining_copy_counts",
        "vllm-project/vllm#48933", "open-pr-schema",
        Batch(TS, [
            BlockStored(H[:2], None, t, BS, group_idx=0, kv_cache_spec_kind="full_attention", **gpu),
            BlockRemoved(H[:2], "GPU", group_idx=0, remaining_copy_counts=[1, 0]),
        ], 0),
        [stored_exp(H[:2], None, t, BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                    kv_cache_spec_kind="full_attention"),
         removed_exp(H[:2], medium="GPU", group_idx=0)],
        {"unknown_keys": 0, "malformed_events": 0, "malformed_removals": 0},
    ))
    out.append(vec(
        "sglang_removal_with_reason",
        "sgl-project/sglang#39620", "open-pr-schema",
        Batch(TS, [
            SgStored(H[2:4], None, t, BS, None, "GPU"),
            SgRemoved([H[3]], "GPU", "demoted"),
            SgRemoved([H[2]], None, "evicted"),
        ], 0),
        [stored_exp(H[2:4], None, t, BS, lora_id=None, medium="GPU"),
         removed_exp([H[3]], medium="GPU"),
         removed_exp([H[2]])],
        {"unknown_keys": 0, "malformed_events": 0, "malformed_removals": 0},
    ))
    raw = toks(2 * BS + 1, 3)
    pages = [[(raw[j], raw[j + 1]) for j in range(p, p + BS)] for p in (0, BS)]
    out.append(vec(
        "sglang_eagle_bigram_stores",
        "sgl-project/sglang v0.5.23 srt/mem_cache/events.py (bigram pages, #39610)",
        "release-source",
        Batch(TS, [
            SgBigramStored([i64(H[1])], None, pages[0], BS, None, "GPU"),
            SgBigramStored([i64(H[3])], i64(H[1]), pages[1], BS, None, "GPU"),
        ], 0),
        # Hash-only: a page's bigrams cover BS + 1 tokens shifted by one, so they are no tokens of
        # the block (docs/engine-wire.md §5.4).
        [stored_exp([H[1]], None, [], BS, lora_id=None, medium="GPU"),
         stored_exp([H[3]], H[1], [], BS, lora_id=None, medium="GPU")],
        {"unknown_keys": 0, "malformed_events": 0, "bigram_stores": 2, "hash_only_stores": 2},
    ))
    out.append(vec(
        "atom_trailing_token_offset_short_layout",
        "ROCm ATOM (token_offset after the known fields)", "open-pr-schema",
        Batch(TS, [AtomStored(H[:2], None, t, BS, None, "GPU", 16)], 0),
        [stored_exp(H[:2], None, t, BS, lora_id=None, medium="GPU")],
        {"unknown_keys": 0, "malformed_events": 0},
    ))
    out.append(vec(
        "atom_trailing_token_offset_long_layout",
        "ROCm ATOM (token_offset after the known fields)", "open-pr-schema",
        Batch(TS, [AtomStoredLong(H[:2], H[3], t, BS, None, "GPU", None, None, 1,
                                  "full_attention", None, 16)], 0),
        [stored_exp(H[:2], H[3], t, BS, lora_id=None, medium="GPU", group_idx=1,
                    kv_cache_spec_kind="full_attention")],
        {"unknown_keys": 1, "malformed_events": 0},
    ))
    # Open medium strings, encoded by vLLM's own classes (medium: str | None).
    from vllm import __version__ as vllm_version
    from vllm.distributed import kv_events as vk

    evs, exp = [], []
    for i, m in enumerate(["cpu", "CXL", "hbm3", "Storage"]):
        h = [H[i]]
        evs.append(vk.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=t[:BS],
                                  block_size=BS, lora_id=None, medium=m, lora_name=None))
        exp.append(stored_exp(h, None, t[:BS], BS, lora_id=None, medium=m, lora_name=None))
        evs.append(vk.BlockRemoved(block_hashes=h, medium=m))
        exp.append(removed_exp(h, medium=m))
    out.append(vec(
        "open_medium_strings", f"vllm-{vllm_version} classes (medium is an open string)",
        "release-classes", vk.KVEventBatch(ts=TS, events=evs, data_parallel_rank=0), exp,
        {"unknown_keys": 0, "malformed_events": 0},
    ))
    # A partial-block store (vLLM 0.32 BlockPool.cache_partial_block: the group, no kind, the
    # partial stretch's length as block_size) before the group's full blocks.
    pt, ft = toks(100, 5), toks(512, 6)
    out.append(vec(
        "partial_block_store_before_full_blocks",
        f"vllm-{vllm_version} classes (BlockPool.cache_partial_block)", "release-classes",
        vk.KVEventBatch(ts=TS, events=[
            vk.BlockStored(block_hashes=[H[0]], parent_block_hash=None, token_ids=pt,
                           block_size=100, lora_id=None, medium="GPU", lora_name=None,
                           group_idx=0),
            vk.BlockStored(block_hashes=H[1:3], parent_block_hash=None, token_ids=ft,
                           block_size=256, lora_id=None, medium="GPU", lora_name=None,
                           group_idx=0, kv_cache_spec_kind="full_attention"),
        ], data_parallel_rank=0),
        [stored_exp([H[0]], None, pt, 100, lora_id=None, medium="GPU", lora_name=None,
                    group_idx=0),
         stored_exp(H[1:3], None, ft, 256, lora_id=None, medium="GPU", lora_name=None,
                    group_idx=0, kv_cache_spec_kind="full_attention")],
        {"filtered_group_conflict": 0, "malformed_events": 0},
    ))
    doc = {
        "about": "Event kinds and fields newer than engine-vectors.json, encoded by msgspec from "
        "class definitions that follow each vector's source (tests/data/new_shapes.py); "
        "`status` says whether a release's classes or an open pull request's schema was used.",
        "vectors": out,
    }
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


main()
