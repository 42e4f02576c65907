"""Builds the tiny model the real-engine tests serve with vLLM: random weights, a local
word-level tokenizer, nothing downloaded.

    python make_model.py DIR

DIR gets a Llama (transformers `LlamaConfig`: hidden 64, 2 layers, 2 heads of 32 (the CPU attention backend has no kernel for heads of 16), vocabulary
512, positions 2048) with weights drawn from a fixed seed and saved as safetensors, and an HF
`tokenizers` WordLevel tokenizer over the words `w0` … `w507` (plus `<unk>`, `<s>`, `</s>`,
`<pad>`) split on whitespace, saved as tokenizer.json + tokenizer_config.json so that vLLM's
AutoTokenizer loads it. A prompt of N such words is N tokens, so the tests know how many KV
blocks a prompt fills.

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
WORDS = 508
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / ".complete").write_text(VERSION + "\n")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py DIR")
    out = Path(sys.argv[1])
    marker = out / ".complete"
    if marker.is_file() and marker.read_text().strip() == VERSION:
        print(out)
        return
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
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
