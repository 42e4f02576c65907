"""Publishes the KV-cache event shapes of tests/it/model_shapes.rs with vLLM's own classes
(`vllm.distributed.kv_events`: BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch) and
its own publisher (ZmqEventPublisher: a PUB and a replay ROUTER), in the real-engine venv
(scripts/vllm-engine-venv.sh). Each event is built as the vLLM 0.32 code that emits the shape
builds it (the file named in its comment); which engine or connector would send what, and why
kvbridge must care, is said in the module doc of tests/it/model_shapes.rs.

usage: publish_shapes.py PUB_PORT REPLAY_PORT

Binds tcp://*:PUB_PORT and tcp://*:REPLAY_PORT, publishes BATCHES (engine seqs 0, 1, …) once,
waits until the publisher thread has sent and buffered them all, prints
{"ready": true, "batches": N}, then answers vllm_ops.py's decoding protocol on stdin (so one
process, one import of vLLM, serves both) until stdin closes; the replay stays available
meanwhile.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_ops  # noqa: E402  (imports vLLM, HF_HUB_OFFLINE set)
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

# KV-cache groups of the one engine this stream comes from.
SLIDING = 0  # a hybrid model's sliding-window group (vLLM puts it first)
FULL = 1  # its full-attention group (last of the hybrid pair)
MLA = 2  # DeepSeek-V4's dense MLA cache, and under the same index its fp4 indexer cache
NEVER_STORED = 7  # a group index no store names
WINDOW = 64  # kv_cache_spec_sliding_window of the sliding group
DEVICE_BS = 16  # tokens per block of the hybrid groups on the GPU
MLA_BS = 256  # DeepSeek-V4's --block-size
INDEXER_BS = 4  # its fp4 indexer cache's block size (llm-d-router #2679)
CHUNK_BLOCKS = 4  # device blocks per offloaded chunk
MOONCAKE_BS = CHUNK_BLOCKS * DEVICE_BS  # the Mooncake store's block: one offload chunk

# vLLM's default int hashes are u64, mostly above i64::MAX: every hash here is (kvbridge folds
# them to int64 by the engine-wire §6 rule).
HASH_BASE = 0xF00D << 48


def blk(prompt, i):
    """Hash of block i of prompt `prompt` (a letter); block 0 is never stored."""
    return HASH_BASE | (ord(prompt) << 16) | i


def toks(prompt, i, size):
    """The `size` token ids of block i of `prompt`."""
    return [(ord(prompt) * 1009 + i * 257 + j) % 50_000 for j in range(size)]


def span(prompt, idx, size):
    return [t for i in idx for t in toks(prompt, i, size)]


def gpu_store(group, kind, prompt, idx, parent=None, size=DEVICE_BS, hashes=None, window=None):
    """The GPU block pool's store (v1/core/block_pool.py): a chain with its tokens. `hashes`
    leaves out null blocks (a sliding group's compacted list) while the tokens still cover
    every block of `idx`."""
    return BlockStored(
        block_hashes=[blk(prompt, i) for i in (hashes or idx)],
        parent_block_hash=parent,
        token_ids=span(prompt, idx, size),
        block_size=size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def gpu_removed(group, prompt, idx):
    """The GPU block pool's eviction (block_pool.py): group_idx, no kind."""
    return BlockRemoved(
        block_hashes=[blk(prompt, i) for i in idx], medium="GPU", group_idx=group
    )


def placeholder(group, medium, key, locality=None, ownership=None):
    """The OffloadingConnector's legacy placeholder (kv_connector/v1/offloading/events.py,
    `_placeholder_stored`): "this chunk's key exists in that tier", no tokens, size 0."""
    return BlockStored(
        block_hashes=[key],
        parent_block_hash=None,
        token_ids=[],
        lora_id=None,
        block_size=0,
        medium=medium,
        lora_name=None,
        group_idx=group,
        locality=locality,
        ownership=ownership,
    )


def chunk_store(medium, prompt, idx, parent=None, locality=None, ownership=None):
    """The OffloadingConnector's self-describing store of one chunk of the full group
    (offloading/events.py, `_take_stored_event`): the chunk's per-block hashes, its tokens,
    the device block size, the group's kind."""
    return BlockStored(
        block_hashes=[blk(prompt, i) for i in idx],
        parent_block_hash=parent,
        token_ids=span(prompt, idx, DEVICE_BS),
        block_size=DEVICE_BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=FULL,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality=locality,
        ownership=ownership,
    )


def chunk_removed(medium, prompt, idx, ownership=None):
    """The OffloadingConnector's eviction of a chunk: all its hashes in one event
    (offloading/events.py, `_take_removed_event`)."""
    return BlockRemoved(
        block_hashes=[blk(prompt, i) for i in idx],
        medium=medium,
        group_idx=FULL,
        ownership=ownership,
    )


def mooncake_store(prompt, i):
    """The Mooncake store connector's store (kv_connector/v1/mooncake/store/worker.py): one
    hash per offloaded chunk, the chunk's tokens and block size, medium lowercase "cpu",
    group_idx and no kind."""
    return BlockStored(
        block_hashes=[blk(prompt, i)],
        parent_block_hash=None,
        token_ids=toks(prompt, i, MOONCAKE_BS),
        block_size=MOONCAKE_BS,
        lora_id=None,
        medium="cpu",
        lora_name=None,
        group_idx=FULL,
    )


def indexer_store(i):
    """DeepSeek-V4-Flash's fp4 indexer cache (llm-d-router #2679): mla_attention under the
    dense cache's group index, block size 4, one hash chained to a parent."""
    return gpu_store(MLA, "mla_attention", "X", [i], parent=blk("X", i - 1), size=INDEXER_BS)


def hybrid(prompt, idx, parent=None):
    """One step of a hybrid model: the sliding group and the full group store the same
    hashes (vLLM mixes no group id into a hash)."""
    return [
        gpu_store(SLIDING, "sliding_window", prompt, idx, parent, window=WINDOW),
        gpu_store(FULL, "full_attention", prompt, idx, parent),
    ]


A4 = [1, 2, 3, 4]
B_LOW, B_HIGH = [1, 2, 3, 4], [5, 6, 7, 8]

BATCHES = [
    # ---- before the cache clear ----
    # 0: prompt A prefilled: both hybrid groups pin their kind (and window) and size 16.
    hybrid("A", A4),
    # 1: DeepSeek-V4: the dense MLA cache pins group MLA at 256; the indexer's store names
    #    the same group at size 4.
    [gpu_store(MLA, "mla_attention", "D", [1], size=MLA_BS), indexer_store(1)],
    # 2: offloading: a legacy placeholder of the full group (a chunk promoted to CPU, key P4);
    #    the KVCR tier's CPU store (ownership "kvcr", v1/kv_offload/tiering/kvcr/manager.py).
    [
        placeholder(FULL, "CPU", blk("P", 4)),
        chunk_store("CPU", "A", A4, ownership="kvcr"),
    ],
    # 3: evictions: the sliding group drops A1 (the full group keeps it); KVCR drops its chunk;
    #    a group never stored; the indexer's block (its group is the dense MLA one).
    [
        gpu_removed(SLIDING, "A", [1]),
        chunk_removed("CPU", "A", A4, ownership="kvcr"),
        gpu_removed(NEVER_STORED, "A", [2]),
        gpu_removed(MLA, "X", [1]),
    ],
    # 4: a prefix-cache reset (it forgets no group: only an engine restart does).
    [AllBlocksCleared()],
    # ---- after it: what is live at the end ----
    # 5: prompt B's first chunk in both hybrid groups.
    hybrid("B", B_LOW),
    # 6: B's second chunk: the full group's chain, the sliding group's with its null blocks
    #    (B5, B6: out of the window) left out of the hashes but not of the tokens; DeepSeek's
    #    dense cache and two more indexer blocks.
    [
        gpu_store(FULL, "full_attention", "B", B_HIGH, parent=blk("B", 4)),
        gpu_store(
            SLIDING,
            "sliding_window",
            "B",
            B_HIGH,
            parent=blk("B", 4),
            hashes=[7, 8],
            window=WINDOW,
        ),
        gpu_store(MLA, "mla_attention", "D", [2, 3], parent=blk("D", 1), size=MLA_BS),
        indexer_store(2),
        indexer_store(3),
    ],
    # 7: B offloaded: both chunks to CPU (self-describing; the second LOCAL), the sliding
    #    group's legacy placeholder (its chunk key B4), the first chunk to STORAGE and a
    #    STORAGE placeholder of the second's key.
    [
        chunk_store("CPU", "B", B_LOW),
        chunk_store("CPU", "B", B_HIGH, parent=blk("B", 4), locality="LOCAL"),
        placeholder(SLIDING, "CPU", blk("B", 4)),
        chunk_store("STORAGE", "B", B_LOW),
        placeholder(FULL, "STORAGE", blk("B", 8)),
    ],
    # 8: other tiers' stores: the Mooncake store (lowercase "cpu", a 64-token chunk as one
    #    block), a REMOTE placeholder, the KVCR tier's CPU chunk of prompt K.
    [
        mooncake_store("M", 1),
        placeholder(FULL, "CPU", blk("R", 1), locality="REMOTE"),
        chunk_store("CPU", "K", A4, ownership="kvcr"),
    ],
    # 9: evictions: the CPU tier drops B's second chunk in one event; the GPU drops B4 (its
    #    CPU copy stays); the sliding group drops B1; a group never stored drops B2; STORAGE
    #    drops the placeholder; DeepSeek's dense cache drops D3, the indexer X2.
    [
        chunk_removed("CPU", "B", B_HIGH),
        gpu_removed(FULL, "B", [4]),
        gpu_removed(SLIDING, "B", [1]),
        gpu_removed(NEVER_STORED, "B", [2]),
        BlockRemoved(block_hashes=[blk("B", 8)], medium="STORAGE", group_idx=FULL),
        gpu_removed(MLA, "D", [3]),
        gpu_removed(MLA, "X", [2]),
    ],
]


def main():
    pub_port, replay_port = (int(p) for p in sys.argv[1:3])
    publisher = ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
    )
    for events in BATCHES:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
    # publish() only queues; the publisher thread marks each batch done once it is sent and
    # in the replay buffer (a batch it fails to send stays undone: then this gives up).
    deadline = time.monotonic() + 30
    while publisher._event_queue.unfinished_tasks:
        if time.monotonic() > deadline:
            sys.exit("the publisher thread did not send every batch within 30 s")
        time.sleep(0.01)
    print(json.dumps({"ready": True, "batches": len(BATCHES)}), flush=True)
    vllm_ops.serve()
    publisher.shutdown()


if __name__ == "__main__":
    main()
