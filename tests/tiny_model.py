"""A tiny random Qwen2 model with a byte-level BPE tokenizer, built locally (no downloads).

`build_tiny_model(path) -> Path` writes a Hugging Face model folder that vLLM and transformers
both load: `config.json`, `model.safetensors`, `generation_config.json`, `tokenizer.json`,
`tokenizer_config.json` (with a Qwen-style chat template whose generation prompt opens
`<think>`). The folder is cached by content: a stamp holds the hash of this file, so it is
rebuilt only when the recipe changes. Building takes a few seconds and is safe to run from
several processes at once (one builds, under a lock file, the others wait and reuse it).

Tokenizer facts the tests rely on (checked at build time):
- special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (EOS), `<think>`, `</think>`;
- `"\\n\\n"` is a single token, `".\\n\\n"` is another one (the delimiter inside a token with text),
  and `"\\n"` is a token of its own (so `\\n` + `\\n` is the delimiter split across two tokens);
- the BPE was trained with exactly the pre-tokenization `Qwen2Tokenizer` applies on loading
  (transformers 5 rebuilds it for qwen2 models), so `AutoTokenizer`, `PreTrainedTokenizerFast`
  and vLLM give the same ids.

The weights are random (seeded) except: dimension 0 of every embedding is a constant, which the
LM-head rows of `\\n\\n`, `.\\n\\n`, `\\n`, ` Wait` and ` but` read (so sampling writes step
delimiters often: steps of a few tokens), and the rows of the special tokens read it negatively
(they are practically never sampled: a request runs to `max_tokens` unless something forces EOS
or `</think>`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB_SIZE = 448  # trained BPE vocabulary incl. the 256 byte symbols, before the specials
HIDDEN = 128
LAYERS = 2
HEADS = 2
KV_HEADS = 1
INTERMEDIATE = 256
MAX_POS = 2048
SEED = 1234

# Qwen2Tokenizer's pre-tokenization (transformers 5, models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking -%}{{ '<think>\\n' }}"
    "{%- else -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}"
)


def _recipe_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _corpus() -> list[str]:
    import random

    rng = random.Random(SEED)
    lines = []
    words = ["Wait", "but", "so", "then", "check", "the", "answer", "is", "try", "again",
             "Let", "me", "think", "Hmm", "Too", "small", "large", "That", "matches", "Therefore"]
    for _ in range(3000):
        a, x, b = rng.randint(2, 9), rng.randint(1, 9), rng.randint(0, 20)
        parts = []
        for _ in range(rng.randint(2, 6)):
            t = rng.randint(1, 9)
            sent = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
            end = rng.choice([".", "", "\n"])  # "\n\n" after text, alone, or as "\n" + "\n\n"
            parts.append(f"Try x = {t}: {a}*{t} + {b} = {a * t + b}. {sent}{end}")
        parts.append(f"Wait, but {a}*{x} + {b} = {a * x + b}. The answer is \\boxed{{{x}}}.")
        lines.append("\n\n".join(parts) + "\n\n")
    return lines


def _train_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def _check_tokenizer(tok) -> None:
    vocab = tok.get_vocab()
    for t in ["ĊĊ", ".ĊĊ", "Ċ"]:
        if t not in vocab:
            raise RuntimeError(f"tiny tokenizer lacks token {t!r}; change the corpus")
    assert tok.encode("a\n\nb").ids[1] == vocab["ĊĊ"]


def _write_model(out: Path, tok) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    vocab = tok.get_vocab()
    n_vocab = max(vocab.values()) + 1
    eos = vocab["<|im_end|>"]
    cfg = Qwen2Config(vocab_size=n_vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos,
                      pad_token_id=vocab["<|endoftext|>"], rope_theta=10000.0,
                      torch_dtype="float32")
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(cfg).float().eval()
    # A constant feature (dimension 0 of every embedding) survives the residual stream and the
    # final norm; LM-head rows reading it make delimiters and keywords likely in every context.
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.3
        ids = torch.randint(0, n_vocab, (16, 64), generator=torch.Generator().manual_seed(SEED))
        h0 = model.model(input_ids=ids).last_hidden_state[..., 0].mean().item()
        for t, logit in [("ĊĊ", 3.8), (".ĊĊ", 3.0), ("Ċ", 2.0), ("ĠWait", 2.0), ("Ġbut", 2.0)]:
            model.lm_head.weight[vocab[t]] = 0.0
            model.lm_head.weight[vocab[t], 0] = logit / h0
        for t in SPECIAL_TOKENS:  # never sampled: requests run to max_tokens unless forced
            model.lm_head.weight[vocab[t]] = 0.0
            model.lm_head.weight[vocab[t], 0] = -10.0 / h0
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(eos_token_id=eos, pad_token_id=vocab["<|endoftext|>"],
                     bos_token_id=None).save_pretrained(out)


def _write_tokenizer(out: Path, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POS,
        "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}))


def _stamp_ok(out: Path, stamp: str) -> bool:
    f = out / ".tiny_model_stamp"
    try:
        return f.read_text() == stamp
    except OSError:
        return False


def build_tiny_model(path: str | os.PathLike) -> Path:
    """Build (or reuse) the tiny model folder at `path`; returns its absolute Path.

    One builder at a time (a lock file beside the folder): the other processes wait and reuse
    its folder. Without the lock two workers built at once, and the one that finished second
    could find the first one's fresh folder, take it for a stale one and remove it while the
    first worker's tests were loading it."""
    out = Path(path).absolute()
    stamp = _recipe_hash()
    if _stamp_ok(out, stamp):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f"{out.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _stamp_ok(out, stamp):  # built while this process waited
            return out
        # built aside and renamed into place: a killed build leaves no half-written folder
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        tmp.mkdir()
        try:
            tok = _train_tokenizer()
            _check_tokenizer(tok)
            _write_tokenizer(tmp, tok)
            _write_model(tmp, tok)
            (tmp / ".tiny_model_stamp").write_text(stamp)
            if out.exists():  # another recipe's folder
                shutil.rmtree(out)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def chat_prompts(tok, questions: list[str]) -> list[str]:
    """Each question as a one-turn chat prompt in the tiny model's template."""
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=False) for q in questions]

if __name__ == "__main__":
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/orca-tiny-model"))
