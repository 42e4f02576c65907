"""Decodes kvbridge's engine-wire messages with vLLM's own msgspec classes.

The classes come from `vllm/distributed/kv_events.py` of the pinned vLLM wheel
(scripts/vllm-events-venv.sh extracts that file and `vllm/v1/core/kv_cache_utils.py`; nothing of
vLLM is in this repository). Only the event classes are used: the modules kv_events.py imports
for its publisher (zmq, vLLM's config, logger and network helpers) are stubbed, so neither torch
nor pyzmq is needed. `ExternalBlockHash` is taken from the wheel's own definition.

stdin: one JSON object per line, {"payload": HEX}; stdout: one JSON line per input, the batch
as msgspec decodes it into `KVEventBatch` (events as {"type": tag, field: value, ...}), or
{"error": why} when vLLM's decoder rejects it.
"""
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

src = Path(sys.argv[1])


class _Any:
    """Stands for every name the stubbed modules export: a type, and a callable."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: None


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        return _Any


utils = (src / "vllm/v1/core/kv_cache_utils.py").read_text()
m = re.search(r"^ExternalBlockHash: TypeAlias = (.+)$", utils, re.M)
assert m, "ExternalBlockHash definition not found in the wheel"
kv_cache_utils = _Stub("vllm.v1.core.kv_cache_utils")
kv_cache_utils.ExternalBlockHash = eval(m.group(1), {"bytes": bytes, "int": int})
for name in ["zmq", "vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger",
             "vllm.utils", "vllm.utils.network_utils", "vllm.v1", "vllm.v1.core"]:
    sys.modules[name] = _Stub(name)
sys.modules["vllm.v1.core.kv_cache_utils"] = kv_cache_utils

spec = importlib.util.spec_from_file_location(
    "vllm.distributed.kv_events", src / "vllm/distributed/kv_events.py")
kv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv)

import msgspec  # noqa: E402

decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)


def event(e):
    d = {"type": type(e).__name__}
    for f in e.__struct_fields__:
        v = getattr(e, f)
        if v is not None:
            d[f] = msgspec.to_builtins(v)
    return d


for line in sys.stdin:
    req = json.loads(line)
    try:
        b = decoder.decode(bytes.fromhex(req["payload"]))
    except msgspec.DecodeError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        continue
    print(json.dumps({"ts": b.ts, "rank": b.data_parallel_rank,
                      "events": [event(e) for e in b.events]}), flush=True)
