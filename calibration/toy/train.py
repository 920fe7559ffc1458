"""Train the toy reasoning model (tokenizer + tiny Qwen2) that orca-serve ships as its demo.

    python -m calibration.toy.train --out orca_serve/demo/model --minutes 14 --seed 0

Recipe and traps: ../shared/notes/TOY-REASONER.md (see calibration/toy/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from calibration.toy.tasks import (
    ALT_FORCE_SUFFIX,
    FORCE_SUFFIX,
    STEP_DELIMITER,
    THINK_OPEN,
    assistant_text,
    make_problem,
    paragraph_candidate,
    trace_paragraphs,
)

EOS, USER, ASSISTANT = "<|endoftext|>", "<|user|>", "<|assistant|>"
# Special tokens are dropped from decoded text; the think tags and the step delimiter must stay
# visible in vLLM's output, so they are added as ordinary (non-special) single tokens.
SPECIAL_TOKENS = (EOS, USER, ASSISTANT)
PLAIN_ADDED_TOKENS = ("<think>", "</think>", STEP_DELIMITER)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# transformers and vLLM load a qwen2 model's tokenizer as Qwen2Tokenizer, which rebuilds this
# exact pipeline (NFC, Qwen's split regex, byte level) whatever tokenizer.json says; training
# with the same pipeline makes the raw, AutoTokenizer and vLLM ids identical.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TOKENIZER_VOCAB = 384
SHIFTED_SHARE = 0.08  # shifted family in training: solved, not memorised
FORCED_SHARE = 0.30  # truncated traces + answer-forcing suffix, loss on the answer only
ALT_SUFFIX_SHARE = 0.25  # of forced examples, use METHOD.md's suffix instead of FORCE_SUFFIX
BOUNDARY_DELIM_SHARE = 0.5  # of forced examples, prefix ends with the step delimiter (online case)


def render_prompt(question: str) -> str:
    """CHAT_TEMPLATE applied to one user message with the generation prompt."""
    return f"{USER}\n{question}\n{ASSISTANT}\n"


def make_example(rng: random.Random) -> tuple[str, int]:
    """One training text and the character offset from which tokens carry loss."""
    family = "shifted" if rng.random() < SHIFTED_SHARE else "in-dist"
    problem = make_problem(rng, family)
    prompt = render_prompt(problem.question)
    paras = trace_paragraphs(problem, rng)
    if rng.random() >= FORCED_SHARE:
        return prompt + assistant_text(paras, problem.x) + EOS, len(prompt)
    k = rng.randint(1, len(paras))
    prefix = THINK_OPEN + "\n" + STEP_DELIMITER.join(paras[:k])
    if rng.random() < BOUNDARY_DELIM_SHARE:
        prefix += STEP_DELIMITER
    suffix = ALT_FORCE_SUFFIX if rng.random() < ALT_SUFFIX_SHARE else FORCE_SUFFIX
    head = prompt + prefix + suffix
    return head + f"{paragraph_candidate(paras[k - 1])}}}", len(head)


def build_tokenizer(rng: random.Random, n_texts: int = 5000) -> Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenization; ids 0-5 are the added tokens."""
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((make_example(rng)[0] for _ in range(n_texts)), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Save as a transformers tokenizer, chat template inside tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=None)
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def encode(tok: Tokenizer, text: str, loss_from: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 before loss_from, by character offset)."""
    enc = tok.encode(text)
    labels = [i if start >= loss_from else -100 for i, (start, _) in zip(enc.ids, enc.offsets)]
    return enc.ids, labels


def packed_batches(
    tok: Tokenizer, rng: random.Random, rows: int, seq_len: int, pad_id: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Rows of whole examples; position_ids restart per example so attention stays within it."""
    pending: tuple[list[int], list[int]] | None = None
    while True:
        ids, pos, labels = [], [], []
        for _ in range(rows):
            row_ids: list[int] = []
            row_pos: list[int] = []
            row_lab: list[int] = []
            while True:
                ex_ids, ex_lab = pending or encode(tok, *make_example(rng))
                pending = None
                if len(ex_ids) > seq_len:  # rare (many slips); would otherwise block every row
                    continue
                if len(row_ids) + len(ex_ids) > seq_len:
                    pending = (ex_ids, ex_lab)
                    break
                row_ids += ex_ids
                row_pos += range(len(ex_ids))
                row_lab += ex_lab
            pad = seq_len - len(row_ids)
            ids.append(row_ids + [pad_id] * pad)
            pos.append(row_pos + list(range(pad)))
            labels.append(row_lab + [-100] * pad)
        yield {
            "input_ids": torch.tensor(ids),
            "position_ids": torch.tensor(pos),
            "labels": torch.tensor(labels),
        }


def lr_factor(step: int, progress: float, warmup: int = 30, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 to `floor` over progress in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_model(vocab_size: int, eos_id: int) -> torch.nn.Module:
    """The brief's tiny Qwen2 (about 2.5 M parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    return Qwen2ForCausalLM(config)


def write_checksums(out: Path) -> None:
    """SHA256SUMS over every file of the model directory (sha256sum -c compatible)."""
    lines = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}"
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "SHA256SUMS"
    ]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def train(out: Path, minutes: float, seed: int, steps: int | None, rows: int, seq_len: int) -> None:
    """Train for a time budget (or a fixed step count) and save model, tokenizer, checksums."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = build_tokenizer(rng)
    eos_id = tok.token_to_id(EOS)
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    model = build_model(vocab, eos_id)
    print(f"tokenizer {tok.get_vocab_size()} tokens, model vocab {vocab}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
    base_lrs = [g["lr"] for g in opt.param_groups]
    batches = packed_batches(tok, rng, rows, seq_len, eos_id)
    budget, start, step, ema = minutes * 60, time.time(), 0, None
    model.train()
    while (step < steps) if steps else (time.time() - start < budget):
        progress = step / steps if steps else (time.time() - start) / budget
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * lr_factor(step, progress)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            # use_cache=False matters: with a cache transformers ignores the packed position_ids
            # and attends across examples (measured: logits differ by 2.4 without it).
            loss = model(**next(batches), use_cache=False).loss
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} ema {ema:.4f} {time.time() - start:.0f}s", flush=True)
    print(f"done: {step} steps, {time.time() - start:.0f}s, final loss (ema) {ema:.4f}", flush=True)
    save(model, tok, out, eos_id)


def save(model: torch.nn.Module, tok: Tokenizer, out: Path, eos_id: int) -> None:
    """float32 safetensors + config + generation config + tokenizer + SHA256SUMS."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = None
    model.float().save_pretrained(out)
    save_tokenizer(tok, out)
    write_checksums(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=14.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead of --minutes")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    train(args.out, args.minutes, args.seed, args.steps, args.rows, args.seq_len)


if __name__ == "__main__":
    main()
