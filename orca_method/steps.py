"""Step segmentation on token ids (docs/METHOD.md section 1), incremental and identical offline/online.

Pure Python: no vLLM import, no torch. The vLLM plugin feeds a `Segmenter` one generated token id
at a time (when that token's hidden state arrives), record mode uses the very same class, and
`segment()` runs it over a finished completion, so online and offline steps agree by construction.

Rules, precisely:

* **Text.** Every token id has a byte string (`TokenTable`, built once from the tokenizer:
  byte-level BPE tokens are mapped back to their raw bytes, SentencePiece `▁`/`<0x0A>` tokens too).
  The completion's text is the concatenation of these bytes.
* **Sections.** The text is cut at the delimiter (default `"\\n\\n"`), scanning left to right
  without overlap (like `str.split`). The token whose bytes complete a delimiter occurrence ends
  the current section and belongs to it, so `"\\n\\n"` inside one token (`".\\n\\n"`) and split
  over two tokens (`"\\n"` + `"\\n"`) both end a section. Bytes after the occurrence inside the same
  token stay with the ended section (token granularity); only they carry over to the next
  delimiter search. A section therefore has at least one token.
* **Steps without keywords** (`keywords=None`): every section is a step. It is complete when the
  token that ends it is fed (online: one decode step after that token was sampled, when its
  hidden state arrives) -> op `STEP`.
* **Steps with keywords** (e.g. `["wait", "but"]`): a section *has a keyword* if its decoded text
  matches one of them as a whole word, case-insensitively (regex `\\b(?:wait|but)\\b`, flag I),
  or, with `keyword_match="substring"` (the authors' rule), contains one of them verbatim
  (case-sensitive, inside words too: list `"Wait"` and `"wait"` separately). The
  first section opens step 1; every later section with a keyword opens a new step; a section
  without one joins the current step. A section is classified when it ends, so a step is complete
  when the *next keyword section ends* -> op `STEP_PREV` (the step is everything before that
  section; that section becomes the start of the next step). Sections that join -> op `MERGE`.
* **Maximum step length** (`max_step_tokens=m`, default none): a step that reaches m counted
  tokens is cut there -> op `STEP` (an ordinary step: A + S), and the tokens after the cut start
  the next step, so long steps become chunks of m tokens and a remainder (the authors' 500-token
  chunks). A section cut in two stays one section for the keyword test, but its rest already
  starts a step (the cut's), so its keyword opens no further step: a keyword line that straddles
  a cut starts its step at the cut rather than at the line's start, the one place where cutting
  online differs from cutting a finished text (docs/METHOD.md section 1).
* **Reasoning phase** (think tags enabled): if the prompt contains the end tag after its last
  start tag (or an end tag and no start tag), there is no reasoning phase at the start; otherwise
  reasoning starts at the first generated token. A generated start tag opens (or re-opens) the
  phase; tags are never counted as step tokens. A generated end tag closes it: op `CLOSE`, the
  pending tokens form the final step (kept by record mode, never scored online). Outside the
  phase tokens are ignored.
* **No think tags** (`ThinkTags.enabled=False`): the whole completion is reasoning.
* **End.** An EOS token (not counted) closes the phase like an end tag (op `CLOSE`); the request
  ending for another reason (max_tokens, stop string, abort) leaves the pending tokens, which
  `finish()` returns as the final step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orca_method.outcomes import KeywordMatch

# Ops returned by Segmenter.feed (what the caller does with its two accumulators:
# A = completed sections of the current step, S = the current section).
NONE = 0  # nothing completed (the token may still have been added to S)
MERGE = 1  # the section ended and joins the current step: A += S; S = 0
STEP = 2  # the section ended and completes a step: step = A + S; A = S = 0
STEP_PREV = 3  # a keyword section ended: step = A; A = S; S = 0
CLOSE = 4  # reasoning ended (end tag / EOS): final step = A + S (record only); A = S = 0

# the defaults of a bundle's `Segmentation` and `ThinkTags` (orca_method/bundle.py), defined once
DEFAULT_DELIMITER = "\n\n"
THINK_START, THINK_END = "<think>", "</think>"

OP_NAMES = {NONE: "none", MERGE: "merge", STEP: "step", STEP_PREV: "step_prev", CLOSE: "close"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-unicode table used by byte-level BPE tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kind(tokenizer: Any) -> str:
    """'bytelevel', 'sentencepiece' or 'decode' (fall back to decoding ids one by one)."""
    backend = (getattr(tokenizer, "backend_tokenizer", None)
               or getattr(tokenizer, "_tokenizer", None))
    if backend is None or not hasattr(backend, "to_str"):
        return "decode"
    try:
        dec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - any unreadable backend: use the slow path
        return "decode"
    kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", []) or []]
    if "ByteLevel" in kinds:
        return "bytelevel"
    if "ByteFallback" in kinds or "Metaspace" in kinds or any(
            d.get("type") == "Replace" for d in dec.get("decoders", []) or []):
        return "sentencepiece"
    return "decode"


def token_bytes_from_tokenizer(tokenizer: Any) -> list[bytes]:
    """The raw bytes of every token id (index = id) of a Hugging Face tokenizer.

    Added/special tokens map to their content. Byte-level tokens are un-mapped exactly; with an
    unknown decoder each id is decoded on its own (partial UTF-8 becomes U+FFFD, which never
    contains a newline, so delimiter detection stays exact for ASCII delimiters).
    """
    vocab: dict[str, int] = tokenizer.get_vocab()
    size = max(max(vocab.values()) + 1, len(tokenizer))
    added = {}
    for tid, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        added[int(tid)] = getattr(tok, "content", str(tok))
    kind = _decoder_kind(tokenizer)
    out = [b""] * size
    inv = {i: s for s, i in vocab.items()}
    for i in range(size):
        if i in added:
            out[i] = added[i].encode("utf-8")
            continue
        s = inv.get(i)
        if s is None:
            continue
        if kind == "bytelevel":
            try:
                out[i] = bytes(_BYTE_DECODER[c] for c in s)
            except KeyError:
                out[i] = s.encode("utf-8")
        elif kind == "sentencepiece":
            m = _SP_BYTE.match(s)
            out[i] = bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode("utf-8")
        else:
            out[i] = tokenizer.decode([i]).encode("utf-8")
    return out


def _get(obj: Any, name: str, default: Any) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass(frozen=True)
class TokenTable:
    """Everything the segmenter needs per token id, precomputed once per tokenizer + settings."""

    token_bytes: Sequence[bytes]
    delimiter: bytes = b"\n\n"
    keywords: tuple[str, ...] | None = None
    keyword_match: KeywordMatch = KeywordMatch.WORD
    max_step_tokens: int | None = None  # cut steps at this many counted tokens
    think_enabled: bool = True
    start_id: int | None = None
    end_id: int | None = None
    eos_ids: frozenset[int] = frozenset()
    has_delim: tuple[bool, ...] = field(default=(), repr=False)  # token bytes contain it whole
    touches: tuple[bool, ...] = field(default=(), repr=False)  # contain any delimiter byte
    # text that can only extend the current section: bytes without a delimiter byte, and not a
    # think tag or EOS (`Segmenter.feed`'s fast path)
    quiet: tuple[bool, ...] = field(default=(), repr=False)
    keyword_re: re.Pattern | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.delimiter:
            raise ValueError("the step delimiter must not be empty")
        dset = set(self.delimiter)
        object.__setattr__(self, "has_delim", tuple(self.delimiter in b for b in self.token_bytes))
        object.__setattr__(self, "touches", tuple(any(c in dset for c in b)
                                                  for b in self.token_bytes))
        special = {self.start_id, self.end_id} if self.think_enabled else set()
        object.__setattr__(self, "quiet", tuple(
            bool(b) and not touch and i not in special and i not in self.eos_ids
            for i, (b, touch) in enumerate(zip(self.token_bytes, self.touches))))
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.keywords:
            alternatives = "|".join(re.escape(k) for k in self.keywords)
            if self.keyword_match == KeywordMatch.WORD:
                regex = re.compile(r"\b(?:" + alternatives + r")\b", re.IGNORECASE)
            elif self.keyword_match == KeywordMatch.SUBSTRING:
                regex = re.compile(alternatives)
            else:
                raise ValueError(f"keyword_match must be one of {', '.join(KeywordMatch)}, "
                                 f"got {self.keyword_match!r}")
            object.__setattr__(self, "keyword_re", regex)
        if self.think_enabled and (self.start_id is None or self.end_id is None):
            raise ValueError("think tags are enabled but their token ids are unknown")

    @classmethod
    def build(cls, token_bytes: Sequence[bytes], vocab: dict[str, int] | None = None, *,
              segmentation: Any = None, think: Any = None,
              eos_ids: Iterable[int] = ()) -> TokenTable:
        """From per-id bytes plus the bundle's `Segmentation` and `ThinkTags` (objects or dicts)."""
        delim = _get(segmentation, "delimiter", DEFAULT_DELIMITER)
        kws = _get(segmentation, "keywords", None)
        match = _get(segmentation, "keyword_match", KeywordMatch.WORD)
        max_step = _get(segmentation, "max_step_tokens", None)
        enabled = bool(_get(think, "enabled", True))
        start_id = end_id = None
        if enabled:
            start, end = _get(think, "start", THINK_START), _get(think, "end", THINK_END)
            if vocab is None or start not in vocab or end not in vocab:
                raise ValueError(f"think tags {start!r}/{end!r} are not single tokens of this "
                                 "tokenizer; set think.enabled=false or use the right model")
            start_id, end_id = vocab[start], vocab[end]
        return cls(token_bytes=tuple(token_bytes), delimiter=delim.encode("utf-8"),
                   keywords=tuple(kws) if kws else None, keyword_match=match,
                   max_step_tokens=max_step, think_enabled=enabled,
                   start_id=start_id, end_id=end_id, eos_ids=frozenset(eos_ids))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, segmentation: Any = None, think: Any = None,
                       eos_ids: Iterable[int] | None = None) -> TokenTable:
        if eos_ids is None:
            eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        return cls.build(token_bytes_from_tokenizer(tokenizer), tokenizer.get_vocab(),
                         segmentation=segmentation, think=think, eos_ids=eos_ids)

    def reasoning_at_start(self, prompt_ids: Sequence[int] | None) -> bool:
        """Whether the completion starts inside the reasoning phase."""
        if not self.think_enabled or not prompt_ids:
            return True
        last_start = last_end = -1
        for i in range(len(prompt_ids) - 1, -1, -1):
            t = prompt_ids[i]
            if t == self.end_id and last_end < 0:
                last_end = i
            elif t == self.start_id:
                last_start = i
                break
        return not (last_end > last_start)


class Segmenter:
    """Per-request incremental segmentation; `feed` one generated token id at a time.

    Tracks token counts (and, with `keep_ids`, the token ids) of the two accumulators the caller
    mirrors with hidden-state sums: A (completed sections of the current step) and S (current
    section). `feed` returns (counted, op): whether the token's hidden state goes into S, then the
    op (module constants) to apply to the accumulators after adding it.
    """

    __slots__ = (
        "a_count",
        "a_ids",
        "counted_total",
        "done",
        "fed",
        "keep_ids",
        "reasoning",
        "s_count",
        "s_ids",
        "sec_text",
        "steps",
        "table",
        "tail",
    )

    def __init__(self, table: TokenTable, prompt_ids: Sequence[int] | None = None,
                 keep_ids: bool = False) -> None:
        self.table = table
        self.reasoning = table.reasoning_at_start(prompt_ids)
        self.done = False  # EOS seen: nothing after counts
        self.tail = b""  # bytes since the last delimiter occurrence (at most len(delim)-1)
        self.sec_text = bytearray()  # current section's bytes (keyword mode only)
        self.a_count = self.s_count = 0
        self.keep_ids = keep_ids
        self.a_ids: list[int] = []
        self.s_ids: list[int] = []
        self.steps: list[list[int]] = []  # completed steps' token ids (keep_ids only)
        self.fed = 0  # tokens fed
        self.counted_total = 0  # tokens counted into steps

    @property
    def pending(self) -> int:
        """Tokens not yet in a completed step."""
        return self.a_count + self.s_count

    def feed(self, tid: int) -> tuple[bool, int]:
        self.fed += 1
        t = self.table
        if self.done:
            return False, NONE
        if self.reasoning and 0 <= tid < len(t.quiet) and t.quiet[tid]:
            # the common case, what the full path below does for such a token
            self.s_count += 1
            self.counted_total += 1
            self.tail = b""
            if self.keep_ids:
                self.s_ids.append(tid)
            if t.keyword_re is not None:
                self.sec_text += t.token_bytes[tid]
            return True, self._cut(NONE)
        if t.think_enabled:
            if tid == t.start_id:
                if not self.reasoning:
                    self.reasoning = True
                    self.tail = b""
                return False, NONE
            if tid == t.end_id:
                if self.reasoning:
                    self.reasoning = False
                    return False, self._close()
                return False, NONE
        if tid in t.eos_ids:
            self.done = True
            if self.reasoning:
                self.reasoning = False
                return False, self._close()
            return False, NONE
        if not self.reasoning:
            return False, NONE
        # A reasoning token: it goes into the current section.
        self.s_count += 1
        self.counted_total += 1
        if self.keep_ids:
            self.s_ids.append(tid)
        return True, self._cut(self._scan(tid))

    def _scan(self, tid: int) -> int:
        """The counted token's bytes: NONE, or the op of the section it ends."""
        t = self.table
        b = t.token_bytes[tid] if 0 <= tid < len(t.token_bytes) else b""
        if t.keyword_re is not None:
            self.sec_text += b
        if not b:
            return NONE  # no text (unknown id): the byte stream is unchanged
        if not t.touches[tid]:
            # no delimiter byte: no occurrence can end here or span this token
            self.tail = b""
            return NONE
        s = self.tail + b
        k = len(t.delimiter)
        pos, last_end = 0, -1
        while True:
            i = s.find(t.delimiter, pos)
            if i < 0:
                break
            last_end = pos = i + k
        if last_end < 0:
            self.tail = s[-(k - 1):] if k > 1 else b""
            return NONE
        rest = s[last_end:]
        self.tail = rest[-(k - 1):] if k > 1 and rest else b""
        return self._section_end()

    def _cut(self, op: int) -> int:
        """A step that reached `max_step_tokens` ends here as an ordinary STEP (A + S).

        Only NONE and MERGE can leave that many tokens pending: the token before had fewer, and
        STEP / STEP_PREV emit at least one. A cut mid-section keeps the section's text (keyword
        test) and its delimiter scan; the rest of the section starts the next step.
        """
        m = self.table.max_step_tokens
        if m is None or op not in (NONE, MERGE) or self.pending < m:
            return op
        self._end_step()
        return STEP

    def _end_step(self) -> None:
        """Everything pending (A + S) becomes one step; the next step starts empty."""
        if self.keep_ids:
            self.steps.append(self.a_ids + self.s_ids)
            self.a_ids, self.s_ids = [], []
        self.a_count = self.s_count = 0

    def _section_end(self) -> int:
        t = self.table
        if t.keyword_re is None:
            op = STEP
        else:
            has_kw = t.keyword_re.search(self.sec_text.decode("utf-8", "replace")) is not None
            self.sec_text = bytearray()
            op = STEP_PREV if (has_kw and self.a_count > 0) else MERGE
        if op == STEP:
            self._end_step()
        elif op == STEP_PREV:
            if self.keep_ids:
                self.steps.append(self.a_ids)
                self.a_ids, self.s_ids = self.s_ids, []
            self.a_count, self.s_count = self.s_count, 0
        else:  # MERGE
            if self.keep_ids:
                self.a_ids += self.s_ids
                self.s_ids = []
            self.a_count += self.s_count
            self.s_count = 0
        return op

    def _close(self) -> int:
        self.tail = b""
        self.sec_text = bytearray()
        if self.pending == 0:
            return NONE
        self._end_step()
        return CLOSE

    def finish(self) -> list[int] | None:
        """The pending final step's token ids at request end (keep_ids), without consuming it."""
        if self.pending == 0:
            return None
        return (self.a_ids + self.s_ids) if self.keep_ids else []


def segment(table: TokenTable, completion_ids: Sequence[int],
            prompt_ids: Sequence[int] | None = None) -> list[list[int]]:
    """Offline: the steps (token ids) of a finished completion, the final pending step included.

    Exactly what record mode returns as `step_token_ids` for the same tokens (record mode sees
    every token but the last one of the completion, whose hidden state is never computed).
    """
    seg = Segmenter(table, prompt_ids, keep_ids=True)
    for tid in completion_ids:
        seg.feed(tid)
    last = seg.finish()
    return seg.steps + ([last] if last else [])
