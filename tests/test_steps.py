"""Step segmentation on token ids (orca_method.steps): no vLLM needed."""

from __future__ import annotations

import random

import pytest

from orca_method.bundle import Segmentation, ThinkTags
from orca_method.steps import (
    CLOSE,
    MERGE,
    NONE,
    STEP,
    STEP_PREV,
    Segmenter,
    TokenTable,
    segment,
    token_bytes_from_tokenizer,
)

# A hand-made vocabulary: id -> bytes
TOKENS = ["a", "b", ".", "\n", "\n\n", ".\n\n", "\n\nx", " Wait", " but", " butter", "Wait",
          "<think>", "</think>", "<eos>", "\n\n\n", "x\n"]
BYTES = [t.encode() for t in TOKENS]
ID = {t: i for i, t in enumerate(TOKENS)}
VOCAB = dict(ID)


def table(keywords=None, think=True, delimiter="\n\n", **seg) -> TokenTable:
    return TokenTable.build(BYTES, VOCAB, segmentation=Segmentation(delimiter=delimiter,
                                                                    keywords=keywords, **seg),
                            think=ThinkTags(enabled=think), eos_ids=[ID["<eos>"]])


def ids(*toks: str) -> list[int]:
    return [ID[t] for t in toks]


def steps_text(steps: list[list[int]]) -> list[str]:
    return ["".join(TOKENS[i] for i in s) for s in steps]


def test_single_token_delimiter_ends_step():
    t = table()
    seg = Segmenter(t, keep_ids=True)
    ops = [seg.feed(i) for i in ids("a", "b", "\n\n", "a", ".\n\n", "b")]
    assert ops == [(True, NONE), (True, NONE), (True, STEP), (True, NONE), (True, STEP),
                   (True, NONE)]
    assert steps_text(seg.steps) == ["ab\n\n", "a.\n\n"]
    assert seg.finish() == ids("b")


def test_delimiter_split_across_two_tokens():
    t = table()
    got = segment(t, ids("a", "\n", "\n", "b", "x\n", "\n", "a"))
    assert steps_text(got) == ["a\n\n", "bx\n\n", "a"]
    # a newline separated by another token does not count
    assert steps_text(segment(t, ids("a", "\n", "b", "\n", "a"))) == ["a\nb\na"]


def test_delimiter_scan_is_left_to_right_without_overlap():
    t = table()
    # "\n\n\n" then "\n": one occurrence inside the first token, the leftover "\n" + "\n" is a
    # second one (like str.split: "a\n\n\n\nb" -> ["a", "", "b"])
    assert steps_text(segment(t, ids("a", "\n\n\n", "\n", "b"))) == ["a\n\n\n", "\n", "b"]
    # text after the delimiter inside the same token stays with the ended step
    assert steps_text(segment(t, ids("a", "\n\nx", "b"))) == ["a\n\nx", "b"]


def test_every_step_has_a_token_and_counts_match():
    t = table()
    seg = Segmenter(t, keep_ids=True)
    for i in ids("\n\n", "\n\n", "a", "\n", "\n"):
        seg.feed(i)
    assert [len(s) for s in seg.steps] == [1, 1, 3]
    assert seg.pending == 0 and seg.counted_total == 5


def test_keyword_rule_merges_sections_and_emits_previous_step():
    t = table(keywords=["wait", "but"])
    seg = Segmenter(t, keep_ids=True)
    seq = ids("a", "\n\n",  # section 1: opens step 1
              "b", "\n\n",  # no keyword: joins step 1
              " Wait", ".", "\n\n",  # keyword: step 1 complete, this section opens step 2
              " butter", "\n\n",  # 'butter' is not the whole word 'but': joins step 2
              "Wait", "\n\n",  # keyword at the start of the text (case-insensitive)
              "b")
    ops = [seg.feed(i)[1] for i in seq]
    assert ops == [NONE, MERGE, NONE, MERGE, NONE, NONE, STEP_PREV, NONE, MERGE, NONE, STEP_PREV,
                   NONE]
    assert steps_text(seg.steps) == ["a\n\nb\n\n", " Wait.\n\n butter\n\n"]
    assert steps_text(segment(t, seq)) == ["a\n\nb\n\n", " Wait.\n\n butter\n\n", "Wait\n\nb"]
    # whole words only: "Waita" has no keyword
    assert steps_text(segment(t, ids("a", "\n\n", " Wait", "a", "\n\n"))) == ["a\n\n Waita\n\n"]


def test_keyword_in_first_section_does_not_emit_an_empty_step():
    t = table(keywords=["but"])
    seg = Segmenter(t, keep_ids=True)
    assert [seg.feed(i)[1] for i in ids(" but", "\n\n", " but", "\n\n")] == [NONE, MERGE, NONE,
                                                                            STEP_PREV]
    assert steps_text(seg.steps) == [" but\n\n"]


def test_think_phase_from_prompt_and_tags():
    t = table()
    # prompt opens <think>: reasoning from the first token; </think> closes it (final step)
    seg = Segmenter(t, prompt_ids=ids("a", "<think>"), keep_ids=True)
    ops = [seg.feed(i) for i in ids("a", "\n\n", "b", "</think>", "a", "\n\n")]
    assert ops == [(True, NONE), (True, STEP), (True, NONE), (False, CLOSE), (False, NONE),
                   (False, NONE)]
    assert steps_text(seg.steps) == ["a\n\n", "b"]
    assert seg.counted_total == 3 and seg.finish() is None


def test_prompt_with_closed_think_has_no_reasoning_phase():
    t = table()
    prompt = ids("<think>", "\n\n", "</think>", "\n\n")
    assert not t.reasoning_at_start(prompt)
    assert segment(t, ids("a", "\n\n", "b"), prompt) == []
    # a generated <think> opens it; the tag itself is not counted
    seg = Segmenter(t, prompt, keep_ids=True)
    ops = [seg.feed(i) for i in ids("a", "<think>", "b", "\n\n", "</think>")]
    assert ops[1] == (False, NONE) and ops[3] == (True, STEP) and ops[4] == (False, NONE)
    assert steps_text(seg.steps) == ["b\n\n"]
    # an end tag without a start tag in the prompt also means "already closed"
    assert not t.reasoning_at_start(ids("a", "</think>"))
    assert t.reasoning_at_start(ids("</think>", "<think>"))
    assert t.reasoning_at_start(None)


def test_eos_closes_and_without_think_tags_everything_is_reasoning():
    t = table(think=False)
    seg = Segmenter(t, prompt_ids=ids("<think>", "</think>"), keep_ids=True)
    ops = [seg.feed(i) for i in ids("</think>", "a", "\n\n", "b", "<eos>", "a")]
    # without think tags the tags are ordinary tokens
    assert ops[0] == (True, NONE)
    assert ops[4] == (False, CLOSE) and ops[5] == (False, NONE)
    assert steps_text(seg.steps) == ["</think>a\n\n", "b"]


def test_other_delimiter():
    t = table(delimiter=".\n")
    assert steps_text(segment(t, ids("a", ".", "\n", "b", ".\n\n", "a"))) == ["a.\n", "b.\n\n",
                                                                              "a"]


def test_offline_segment_equals_online_feed(tmp_path):
    """Same class online and offline: feeding all but the last token (as record mode does when
    the request ends on max_tokens) plus finish() gives segment() of the same tokens minus the
    last one."""
    import random

    rng = random.Random(0)
    t = table(keywords=["wait", "but"])
    for _ in range(200):
        seq = [rng.randrange(len(TOKENS)) for _ in range(rng.randint(1, 40))]
        seg = Segmenter(t, prompt_ids=ids("<think>"), keep_ids=True)
        for i in seq:
            seg.feed(i)
        last = seg.finish()
        online = seg.steps + ([last] if last else [])
        assert online == segment(t, seq, ids("<think>"))
        assert all(len(s) >= 1 for s in online)
        assert sum(map(len, online)) == seg.counted_total


def _steps_from_ops(t: TokenTable, seq: list[int], prompt: list[int]) -> list[list[int]]:
    """The steps a caller that only sees (counted, op) builds, mirroring the plugin's two
    accumulators (A: completed sections of the step, S: the current section) with token ids."""
    seg = Segmenter(t, prompt)  # no keep_ids: only the protocol
    a: list[int] = []
    s: list[int] = []
    steps = []
    for tid in seq:
        counted, op = seg.feed(tid)
        if counted:
            s.append(tid)
        if op == MERGE:
            a, s = a + s, []
        elif op in (STEP, CLOSE):
            steps.append(a + s)
            a, s = [], []
        elif op == STEP_PREV:
            steps.append(a)
            a, s = s, []
    return steps + ([a + s] if a + s else [])


@pytest.mark.parametrize("seg", [
    {"max_step_tokens": 3},
    {"max_step_tokens": 1},
    {"max_step_tokens": 4, "keywords": ["wait", "but"]},
    {"max_step_tokens": 2, "keywords": ["Wait", "but"], "keyword_match": "substring",
     "delimiter": "\n"},
    {"keywords": ["but"], "keyword_match": "substring"},
])
def test_online_ops_equal_offline_segment(seg):
    """The protocol the plugin follows (ops on two accumulators) gives exactly the steps of the
    offline segmentation used by collection and replay, with cuts and keyword modes on."""
    import random

    rng = random.Random(1)
    t = table(**seg)
    m = seg.get("max_step_tokens")
    for _ in range(300):
        seq = [rng.randrange(len(TOKENS)) for _ in range(rng.randint(1, 60))]
        offline = segment(t, seq, ids("<think>"))
        assert _steps_from_ops(t, seq, ids("<think>")) == offline
        assert all(1 <= len(x) <= (m or len(seq)) for x in offline)


def test_max_step_tokens_chunks_steps_like_the_authors():
    """Without keywords every section is a step, so cutting online is exactly cutting every
    finished step into chunks of m tokens and a remainder (the authors' split of long steps)."""
    import random

    rng = random.Random(2)
    plain = table()
    for m in (1, 2, 5):
        cut = table(max_step_tokens=m)
        for _ in range(200):
            seq = [rng.randrange(len(TOKENS)) for _ in range(rng.randint(1, 50))]
            chunks = [s[i:i + m] for s in segment(plain, seq) for i in range(0, len(s), m)]
            assert segment(cut, seq) == chunks


def test_max_step_tokens_cut_is_an_ordinary_step_op():
    t = table(max_step_tokens=3)
    seg = Segmenter(t, keep_ids=True)
    ops = [seg.feed(i)[1] for i in ids("a", "b", "a", "b", "\n\n", "a", "b", "\n\n")]
    # the 3rd token cuts; "b\n\n" ends its section (STEP); "ab\n\n" reaches 3 at the delimiter
    assert ops == [NONE, NONE, STEP, NONE, STEP, NONE, NONE, STEP]
    assert steps_text(seg.steps) == ["aba", "b\n\n", "ab\n\n"]
    # with keywords a merge that reaches the limit is the cut too (A + S form the step)
    t = table(keywords=["wait"], max_step_tokens=4)
    seg = Segmenter(t, keep_ids=True)
    ops = [seg.feed(i)[1] for i in ids("a", "\n\n", "b", "\n\n", "a")]
    assert ops == [NONE, MERGE, NONE, STEP, NONE]
    assert steps_text(seg.steps) == ["a\n\nb\n\n"]


def test_keyword_line_straddling_a_cut_starts_its_step_at_the_cut():
    t = table(keywords=["wait"], max_step_tokens=3)
    got = segment(t, ids("a", "\n\n", " Wait", "b", "\n\n", "a"))
    # offline on finished text the step would start at " Wait"; online the cut came first
    assert steps_text(got) == ["a\n\n Wait", "b\n\na"]


def test_substring_keywords_are_verbatim():
    """The authors' rule: a line containing the keyword anywhere, case as listed."""
    word = table(keywords=["but"], delimiter="\n")
    sub = table(keywords=["but"], delimiter="\n", keyword_match="substring")
    seq = ids("a", "\n", " butter", "\n", "b", "\n")
    assert steps_text(segment(word, seq)) == ["a\n butter\nb\n"]
    assert steps_text(segment(sub, seq)) == ["a\n", " butter\nb\n"]
    # case-sensitive: "Wait" is not "wait"
    assert len(segment(table(keywords=["wait"], keyword_match="substring"),
                       ids("a", "\n\n", "Wait", "\n\n"))) == 1
    assert len(segment(table(keywords=["Wait"], keyword_match="substring"),
                       ids("a", "\n\n", "Wait", "\n\n"))) == 2
    with pytest.raises(ValueError, match="max_step_tokens"):
        TokenTable.build(BYTES, VOCAB, segmentation={"max_step_tokens": 0}, think={"enabled": False})


def test_table_from_tiny_tokenizer(tok):
    by = token_bytes_from_tokenizer(tok)
    text = "Try x = 5.\n\nWait, but 3\n\n\nok é"
    enc = tok.encode(text, add_special_tokens=False)
    assert b"".join(by[i] for i in enc) == text.encode()
    assert by[tok.convert_tokens_to_ids("</think>")] == b"</think>"
    t = TokenTable.from_tokenizer(tok, segmentation=Segmentation(), think=ThinkTags())
    got = segment(t, enc, tok.encode("<think>\n", add_special_tokens=False))
    assert [tok.decode(s) for s in got] == ["Try x = 5.\n\n", "Wait, but 3\n\n\n", "ok é"]
    with pytest.raises(ValueError, match="not single tokens"):
        TokenTable.from_tokenizer(tok, think=ThinkTags(start="<reason>"))


@pytest.mark.parametrize("settings", [{}, {"keywords": ["Wait", "but"]}, {"max_step_tokens": 3},
                                      {"keywords": ["but"], "max_step_tokens": 4},
                                      {"think": False}])
def test_quiet_token_fast_path_equals_the_full_path(settings):
    """`feed` takes a shortcut for tokens that can only extend the section (`TokenTable.quiet`):
    on random streams (tags, EOS, delimiters, keywords) it gives the ops, counts and step ids
    of the full path, which a table with no quiet token forces."""
    fast = table(**settings)
    full = table(**settings)
    object.__setattr__(full, "quiet", (False,) * len(BYTES))
    assert any(fast.quiet) and not any(full.quiet)
    rng = random.Random(0)
    for _ in range(200):
        stream = [rng.randrange(len(TOKENS)) for _ in range(rng.randrange(1, 60))]
        a, b = Segmenter(fast, keep_ids=True), Segmenter(full, keep_ids=True)
        assert [a.feed(t) for t in stream] == [b.feed(t) for t in stream]
        assert (a.steps, a.finish(), a.counted_total) == (b.steps, b.finish(), b.counted_total)
