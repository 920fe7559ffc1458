"""Train the toy reasoning model (tokenizer + tiny Qwen2) that orca-serve ships as its demo.

    python -m orca_demo.toy.train --out orca_serve/demo/model --minutes 14 --seed 0

Recipe and traps: orca_demo/toy/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from orca_demo.toy.tasks import (
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
# The served template opens the reasoning (DeepSeek-R1 style: the generation prompt ends with
# `<think>`), so the model's output starts inside it. Training texts write `<think>` after
# render_prompt's generation prompt, so the tokens from `<think>` on are the same either way.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n<think>' }}{% endif %}"
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
ALT_SUFFIX_SHARE = 0.25  # of forced examples, use ALT_FORCE_SUFFIX instead of FORCE_SUFFIX
BOUNDARY_DELIM_SHARE = 0.5  # of forced examples, prefix ends with the step delimiter (online case)
# The verdict after each try decides the walk, but is ~3% of the tokens: at weight 1 an 800-step
# run said "Too big." for "56 + 6 = 62, want 62" (matches recognised 40% of the time).
DECISION_WEIGHT = 5.0
# What the demos' calibration jobs sample at (orca_calibrate/jobs/toy.yaml and long.yaml,
# `collect.temperature`; top_p they leave at 1), written into each model's generation_config.json
# (`advise_sampling`): vLLM samples a request that sets no temperature at the file's, as it does
# a real model at its advised one, so the demos' default traffic is their calibration's
# (tests/test_demo.py checks the two agree).
SAMPLING_TEMPERATURE = 0.7
_VERDICT_RE = re.compile(r" (?:Too small|Too big|That matches)(?=\.)")


# One training text, the character offset from which tokens carry loss, and an optional
# character span inside it without loss (the answer-forcing suffix of a forced example).
Example = tuple[str, int, tuple[int, int] | None]


@dataclass(frozen=True)
class Recipe:
    """What differs between the reasoners trained by this module: how a training example is
    drawn, which words decide the next step (weighted DECISION_WEIGHT), the longest sequence the
    model must handle, and the model's width and depth."""

    name: str
    example: Callable[[random.Random], Example]
    decision_re: re.Pattern[str]
    max_positions: int
    hidden_size: int = 256
    layers: int = 4


def render_prompt(question: str) -> str:
    """One user message with the generation prompt, as training texts start (CHAT_TEMPLATE
    gives this followed by `<think>`)."""
    return f"{USER}\n{question}\n{ASSISTANT}\n"


def trace_example(rng: random.Random, prompt: str, paras: list[str], answer: int,
                  candidate: Callable[[str], int | None], *, train_prefix: bool) -> Example:
    """A full trace, or (FORCED_SHARE) one cut after k paragraphs, closed by an answer-forcing
    suffix and answered with the candidate of its last paragraph. A forced example never trains
    the suffix (the model must not learn to close its thinking early); its reasoning prefix is
    trained only with `train_prefix` (a long prefix is too costly to train one answer from)."""
    if rng.random() >= FORCED_SHARE:
        return prompt + assistant_text(paras, answer) + EOS, len(prompt), None
    k = rng.randint(1, len(paras))
    prefix = THINK_OPEN + "\n" + STEP_DELIMITER.join(paras[:k])
    if rng.random() < BOUNDARY_DELIM_SHARE:
        prefix += STEP_DELIMITER
    suffix = ALT_FORCE_SUFFIX if rng.random() < ALT_SUFFIX_SHARE else FORCE_SUFFIX
    head = prompt + prefix + suffix
    text = head + f"{candidate(paras[k - 1])}}}"
    if train_prefix:
        return text, len(prompt), (len(prompt + prefix), len(head))
    return text, len(head), None


def make_example(rng: random.Random) -> Example:
    """One toy training example (see Example); forced ones carry loss on the answer only."""
    family = "shifted" if rng.random() < SHIFTED_SHARE else "in-dist"
    problem = make_problem(rng, family)
    return trace_example(rng, render_prompt(problem.question), trace_paragraphs(problem, rng),
                         problem.x, paragraph_candidate, train_prefix=False)


TOY = Recipe("toy", make_example, _VERDICT_RE, max_positions=1024)


def build_tokenizer(rng: random.Random, n_texts: int = 5000, recipe: Recipe = TOY) -> Tokenizer:
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
    tok.train_from_iterator((recipe.example(rng)[0] for _ in range(n_texts)), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Save as a transformers tokenizer, chat template inside tokenizer_config.json."""
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=None)
    hf.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def encode(tok: Tokenizer, text: str, loss_from: int, skip: tuple[int, int] | None = None,
           decision_re: re.Pattern[str] = _VERDICT_RE) -> tuple[list[int], list[float]]:
    """Token ids and loss weights: 0 before loss_from and inside skip (by character offset),
    DECISION_WEIGHT on decision words, 1 elsewhere."""
    enc = tok.encode(text)
    verdicts = [(m.start(), m.end()) for m in decision_re.finditer(text)]  # [start, end)

    def weight(start: int) -> float:
        if start < loss_from or (skip is not None and skip[0] <= start < skip[1]):
            return 0.0
        return DECISION_WEIGHT if any(a <= start < b for a, b in verdicts) else 1.0

    return enc.ids, [weight(start) for start, _ in enc.offsets]


def packed_batch(tok: Tokenizer, rng: random.Random, rows: int, seq_len: int, pad_id: int,
                 recipe: Recipe = TOY) -> dict[str, torch.Tensor]:
    """Rows of whole examples; position_ids restart per example so attention stays within it.
    One rng per step (no carry-over) makes a resumed run see exactly the same data."""
    ids, pos, weights = [], [], []
    pending: tuple[list[int], list[float]] | None = None
    for _ in range(rows):
        row_ids: list[int] = []
        row_pos: list[int] = []
        row_w: list[float] = []
        while True:
            if pending is None:
                text, loss_from, skip = recipe.example(rng)
                pending = encode(tok, text, loss_from, skip, recipe.decision_re)
            ex_ids, ex_w = pending
            pending = None
            if len(ex_ids) > seq_len:  # rare (many slips); once blocked every later row (NaN loss)
                continue
            if len(row_ids) + len(ex_ids) > seq_len:
                pending = (ex_ids, ex_w)
                break
            row_ids += ex_ids
            row_pos += range(len(ex_ids))
            row_w += ex_w
        pad = seq_len - len(row_ids)
        ids.append(row_ids + [pad_id] * pad)
        pos.append(row_pos + list(range(pad)))
        weights.append(row_w + [0.0] * pad)
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos), "weights": torch.tensor(weights)}


def weighted_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Weighted next-token loss, and the plain mean over trained tokens (for the log).
    use_cache=False matters: with a cache transformers ignores the packed position_ids and
    attends across examples (measured: logits differ by 2.4 without it)."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["input_ids"][:, 1:].flatten(), reduction="none"
    )
    w = batch["weights"][:, 1:].flatten()
    return (ce * w).sum() / w.sum(), ce[w > 0].mean().item()


def lr_factor(step: int, progress: float, warmup: int = 30, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps, then cosine from 1 to `floor` over progress in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_model(vocab_size: int, eos_id: int, recipe: Recipe = TOY) -> torch.nn.Module:
    """A tiny Qwen2 (the toy's: about 2.5 M parameters)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=2 * recipe.hidden_size,
        num_hidden_layers=recipe.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=recipe.max_positions,
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


def advise_sampling(out: Path | str) -> None:
    """Write the calibration's sampling (`SAMPLING_TEMPERATURE`) into the generation config of
    the model folder `out` and seal the folder again (`write_checksums`); the weights, config and
    tokenizer stay as they are, and with them the bundles' model fingerprints (config.json's shape
    and the vocabulary). Also how the shipped demo models got theirs, after training:
    `python -c "from orca_demo.toy.train import advise_sampling; advise_sampling('DIR')"`."""
    out = Path(out)
    gen = GenerationConfig.from_pretrained(out)
    gen.do_sample = True  # transformers refuses to save a temperature without it
    gen.temperature = SAMPLING_TEMPERATURE
    gen.save_pretrained(out)
    write_checksums(out)


def train(
    out: Path, minutes: float, seed: int, steps: int | None, rows: int, seq_len: int, checkpoint: Path,
    recipe: Recipe = TOY, init: Path | None = None, lr: float = 2e-3,
) -> None:
    """Train for a time budget (or a fixed step count) and save model, tokenizer, checksums.
    Resumes from `checkpoint` (written every 25 steps) when its settings match: other jobs on
    this machine have killed long runs. `init`: a model folder this function saved (same recipe)
    to start from, with its tokenizer, for a second phase on longer rows or a reworded task."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    # A later phase keeps the tokenizer its weights were trained with (a rebuilt one would differ
    # as soon as the task's wording does, and the embeddings would then mean other pieces).
    tok = (Tokenizer.from_file(str(init / "tokenizer.json")) if init is not None
           else build_tokenizer(random.Random(seed), recipe=recipe))
    eos_id = tok.token_to_id(EOS)
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    model = build_model(vocab, eos_id, recipe)
    if init is not None:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(init / "model.safetensors"), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is not saved
            raise ValueError(f"{init} is not a model of this recipe ({missing=}, {unexpected=})")
        model.tie_weights()
        print(f"starting from {init}", flush=True)
    print(f"tokenizer {tok.get_vocab_size()} tokens, model vocab {vocab}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    base_lrs = [g["lr"] for g in opt.param_groups]
    key = {"recipe": recipe.name, "seed": seed, "steps": steps, "minutes": minutes, "rows": rows,
           "seq_len": seq_len, "init": str(init), "lr": lr}
    state = {"step": 0, "ema": None, "elapsed": 0.0}
    if checkpoint.exists() and (ckpt := torch.load(checkpoint, weights_only=False))["key"] == key:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state = ckpt["state"]
        print(f"resumed from {checkpoint} at step {state['step']}", flush=True)
    budget, start = minutes * 60, time.time() - state["elapsed"]
    model.train()
    while (state["step"] < steps) if steps else (time.time() - start < budget):
        step = state["step"]
        progress = step / steps if steps else (time.time() - start) / budget
        for g, lr in zip(opt.param_groups, base_lrs):
            g["lr"] = lr * lr_factor(step, progress)
        batch = packed_batch(tok, random.Random(f"{seed}:{step}"), rows, seq_len, eos_id, recipe)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, plain = weighted_loss(model, batch)
        if not torch.isfinite(loss):
            raise RuntimeError(f"non-finite loss at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = plain if state["ema"] is None else 0.95 * state["ema"] + 0.05 * plain
        state = {"step": step + 1, "ema": ema, "elapsed": time.time() - start}
        if state["step"] % 25 == 0:
            print(f"step {state['step']} weighted {loss.item():.4f} loss {plain:.4f} ema {ema:.4f} "
                  f"{state['elapsed']:.0f}s", flush=True)
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"key": key, "model": model.state_dict(), "opt": opt.state_dict(), "state": state}, tmp)
            tmp.replace(checkpoint)
    print(f"done: {state['step']} steps, {state['elapsed']:.0f}s, final loss (ema) {state['ema']:.4f}", flush=True)
    save(model, tok, out, eos_id)
    checkpoint.unlink(missing_ok=True)


def save(model: torch.nn.Module, tok: Tokenizer, out: Path, eos_id: int) -> None:
    """float32 safetensors + config + generation config (with the calibration's sampling) +
    tokenizer + SHA256SUMS."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = None
    model.float().save_pretrained(out)
    save_tokenizer(tok, out)
    advise_sampling(out)


def main(recipe: Recipe = TOY, description: str = __doc__, minutes: float = 14.0, rows: int = 16,
         seq_len: int = 512) -> None:
    """The training command line of one recipe (its defaults are the shipped model's)."""
    ap = argparse.ArgumentParser(description=description.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=minutes)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead of --minutes")
    ap.add_argument("--rows", type=int, default=rows)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--checkpoint", type=Path, default=None, help="resume file (default: in the temp dir)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--init", type=Path, default=None,
                    help="start from a model folder saved by an earlier phase (same recipe; its tokenizer is kept)")
    args = ap.parse_args()
    ckpt = args.checkpoint or Path(tempfile.gettempdir()) / f"orca-{recipe.name}-train-seed{args.seed}.pt"
    train(args.out, args.minutes, args.seed, args.steps, args.rows, args.seq_len, ckpt, recipe,
          args.init, args.lr)


if __name__ == "__main__":
    main()
