"""Builds the tiny models the real-engine tests serve with vLLM: random weights, a local
word-level tokenizer, nothing downloaded.

    python make_model.py DIR [KIND]

KIND is `llama` (the default), `gemma3` or `gemma4`. With `llama`, DIR gets a Llama
(transformers `LlamaConfig`: hidden 64, 2 layers, 2 heads of 32 (the CPU attention backend has
no kernel for heads of 16), vocabulary 512, positions 2048) with weights drawn from a fixed seed
and saved as safetensors, and an HF `tokenizers` WordLevel tokenizer over the words `w0` …
`w507` (plus `<unk>`, `<s>`, `</s>`, `<pad>`) split on whitespace, saved as tokenizer.json +
tokenizer_config.json so that vLLM's AutoTokenizer loads it. A prompt of N such words is N
tokens, so the tests know how many KV blocks a prompt fills.

The other kinds are hybrid models with the same tokenizer: their sliding-window and full-attention
layers alternate, so vLLM gives them two KV-cache groups (group 0 sliding, group 1 full;
docs/engine-wire.md §9.1), which tests/it/real_hybrid.rs serves.

- `gemma3`: a text-only Gemma-3 (`Gemma3ForCausalLM`): hidden 64, 2 layers (sliding, full), 2
  heads of 32 sharing 1 KV head, sliding window 64: both groups have one block size.
- `gemma4`: a text-only Gemma-4 (`Gemma4ForCausalLM`): as `gemma3`, but the full layer's heads are
  64 wide (`global_head_dim`), twice the sliding layer's 32, so that vLLM, which gives every group
  the same page size, gives the sliding group blocks of twice the full group's tokens (64 and 32
  with `--block-size 32`); no per-layer embeddings.

Idempotent: a DIR that holds the `.complete` marker of this version is left as it is; anything
else at DIR is replaced (built in DIR.tmpPID, then renamed into place).
"""
import json
import os
import shutil
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# Bump when the model or tokenizer changes, so that a cached directory is rebuilt.
VERSION = "2"
# The same for each hybrid kind (its marker reads KIND-VERSION).
HYBRID_VERSION = {"gemma3": "1", "gemma4": "1"}
WORDS = 508
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build(out: Path, kind: str, version: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for w in range(WORDS):
        vocab[f"w{w}"] = len(vocab)
    assert len(vocab) == 512

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.save_pretrained(out)

    torch.manual_seed(0)
    model = {"llama": llama, "gemma3": gemma3, "gemma4": gemma4}[kind](vocab)
    model.save_pretrained(out, safe_serialization=True)
    (out / ".complete").write_text(version + "\n")


def llama(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


# What the two hybrid kinds share: sliding and full layers alternating, the sliding window.
HYBRID_LAYERS = ["sliding_attention", "full_attention"]
SLIDING_WINDOW = 64


def hybrid_config(vocab):
    """The settings both hybrid kinds share: tiny, one sliding and one full layer."""
    return dict(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(HYBRID_LAYERS),
        layer_types=HYBRID_LAYERS,
        sliding_window=SLIDING_WINDOW,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        torch_dtype="float32",
    )


def gemma3(vocab):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(
        Gemma3TextConfig(**hybrid_config(vocab), query_pre_attn_scalar=32)
    )


def gemma4(vocab):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    # The full layer's heads are larger: a different block size per group.
    return Gemma4ForCausalLM(
        Gemma4TextConfig(
            **hybrid_config(vocab), global_head_dim=64, hidden_size_per_layer_input=0
        )
    )


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: make_model.py DIR [llama|gemma3|gemma4]")
    out = Path(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) == 3 else "llama"
    if kind != "llama" and kind not in HYBRID_VERSION:
        sys.exit(f"make_model.py: unknown model kind {kind!r}")
    version = VERSION if kind == "llama" else f"{kind}-{HYBRID_VERSION[kind]}"
    marker = out / ".complete"
    if marker.is_file() and marker.read_text().strip() == version:
        print(out)
        return
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp, kind, version)
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        # Another builder renamed its (identical) copy into place first.
        shutil.rmtree(tmp, ignore_errors=True)
        if not marker.is_file():
            raise
    print(out)


if __name__ == "__main__":
    main()
