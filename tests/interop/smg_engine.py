"""A minimal vLLM-shaped gRPC engine for the real-gateway test (tests/it/gateway.rs).

It answers what an SMG gateway asks of a gRPC worker while registering and routing:
`VllmEngine/HealthCheck`, `GetModelInfo` (pointing at a local tokenizer directory), and
`Generate` (one `GenerateComplete` with a single token), `GetLoads` (the running-request count
read from a file the test writes), and refuses every other method with
UNIMPLEMENTED, as a real engine of another runtime would. Each Generate's prompt token ids are
appended, one JSON line per call, to the log file given on the command line: the test's evidence
of which engine the gateway routed a request to.

Messages are encoded by hand (protobuf wire format), from the field numbers of SMG's
`vllm_engine.proto`; nothing of SMG's is imported.

    python smg_engine.py PORT NAME TOKENIZER_DIR LOG_FILE
"""

import json
import sys
from concurrent import futures

import grpc

PORT, NAME, TOKENIZER_DIR, LOG = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    return varint(num << 3 | wire) + payload


def f_varint(num, n):
    return field(num, 0, varint(n))


def f_bytes(num, b):
    return field(num, 2, varint(len(b)) + b)


def read_fields(buf):
    """(number, wire type, value) of each top-level field; value is int or bytes."""
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = read_varint(buf, i)
        elif wire == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % wire)
        yield num, wire, v


def read_varint(buf, i):
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def prompt_ids(request):
    """GenerateRequest.tokenized (2) → TokenizedInput.input_ids (2, packed uint32)."""
    for num, wire, v in read_fields(request):
        if num == 2 and wire == 2:
            for n2, w2, v2 in read_fields(v):
                if n2 == 2 and w2 == 2:
                    ids, i = [], 0
                    while i < len(v2):
                        x, i = read_varint(v2, i)
                        ids.append(x)
                    return ids
                if n2 == 2 and w2 == 0:
                    return [v2]
    return []


def health(_req, _ctx):
    return f_varint(1, 1) + f_bytes(2, b"ok")  # healthy, message


def model_info(_req, _ctx):
    return (
        f_bytes(1, TOKENIZER_DIR.encode())  # model_path
        + f_varint(2, 1)  # is_generation
        + f_varint(3, 4096)  # max_context_length
        + f_varint(4, 1000)  # vocab_size
        + f_bytes(6, b"kvbridge-test-model")  # served_model_name
        + f_bytes(7, TOKENIZER_DIR.encode())  # tokenizer_path
        + f_bytes(10, varint(2))  # eos_token_ids (packed)
    )


def generate(req, _ctx):
    ids = prompt_ids(req)
    with open(LOG, "a") as f:
        f.write(json.dumps({"engine": NAME, "prompt": ids}) + "\n")
    complete = (
        f_bytes(1, varint(7))  # output_ids
        + f_bytes(2, b"stop")  # finish_reason
        + f_varint(3, len(ids))  # prompt_tokens
        + f_varint(4, 1)  # completion_tokens
    )
    yield f_bytes(2, complete)  # GenerateResponse.complete


def get_loads(_req, _ctx):
    """vLLM GetLoadsResponse: dp_rank_count (3) = 1, one SchedulerLoad (4) whose
    num_running_reqs (2) is read from LOG + ".running-" + NAME (0 when absent)."""
    try:
        with open(LOG + ".running-" + NAME) as f:
            running = int(f.read().strip() or 0)
    except OSError:
        running = 0
    load = f_varint(2, running) + f_varint(3, 0) + f_varint(11, 256)
    return f_varint(3, 1) + f_bytes(4, load)


def raw(b):
    return b


HANDLERS = {
    "/vllm.grpc.engine.VllmEngine/HealthCheck": grpc.unary_unary_rpc_method_handler(
        health, request_deserializer=raw, response_serializer=raw),
    "/vllm.grpc.engine.VllmEngine/GetModelInfo": grpc.unary_unary_rpc_method_handler(
        model_info, request_deserializer=raw, response_serializer=raw),
    "/vllm.grpc.engine.VllmEngine/GetLoads": grpc.unary_unary_rpc_method_handler(
        get_loads, request_deserializer=raw, response_serializer=raw),
    "/vllm.grpc.engine.VllmEngine/Generate": grpc.unary_stream_rpc_method_handler(
        generate, request_deserializer=raw, response_serializer=raw),
}


class Handler(grpc.GenericRpcHandler):
    def service(self, details):
        return HANDLERS.get(details.method)


server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[Handler()])
server.add_insecure_port("127.0.0.1:" + PORT)
server.start()
print("ready", flush=True)
server.wait_for_termination()
