"""Judge labels (docs/METHOD.md section 3): a model behind any OpenAI-compatible endpoint grades answers.

For tasks where answer equivalence cannot grade (free-form answers, no reference), a judge says
whether each step's intermediate answer is a correct final answer. Step answers repeat heavily
along a trajectory (the answer settles and stays), so each unique (question, reference,
normalised answer) is asked once and cached, and the unique ones of a whole batch of problems are
sent concurrently. A reply that is neither yes nor no counts as 0 and is counted, so a judge that
ignores the one-word instruction shows up in the collection stats instead of passing silently.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from typing import Any

from orca_method.labels import normalise

SYSTEM = "You grade answers to problems. Reply with exactly one word: yes or no."
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)

Key = tuple[str, str | None, str]
Item = tuple[str, str | None, Sequence[str | None]]  # question, reference, step answers


class JudgeError(RuntimeError):
    """The judge endpoint cannot be used (unreachable, key refused, bad settings); one line."""


@dataclass
class JudgeSettings:
    base_url: str  # OpenAI-compatible, e.g. http://localhost:8001/v1
    model: str
    api_key_env: str | None = None  # name of the environment variable holding the key
    concurrency: int = 16  # requests in flight
    max_tokens: int = 8  # the reply is one word
    timeout: float = 60.0  # seconds per request
    max_retries: int = 2  # the openai client's retries (connection errors, 429, 5xx)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> JudgeSettings:
        """Settings from a job file's `collect: {judge: {...}}` block, with errors naming keys."""
        known = [f.name for f in fields(cls)]
        if not isinstance(d, Mapping):
            raise JudgeError(f"{where}: judge must be a mapping with keys {known}")
        missing = [k for k in ("base_url", "model") if not d.get(k)]
        unknown = sorted(set(d) - set(known))
        if missing or unknown:
            raise JudgeError(f"{where}: judge needs base_url and model (missing {missing}, "
                             f"unknown {unknown}; known: {known})")
        return cls(**d)


def question_text(rec: Mapping[str, Any]) -> str:
    """What the judge is shown as the problem: the last user message, or the raw prompt."""
    messages = rec.get("messages")
    if not messages:
        return rec["prompt"]
    user = [m for m in messages if m.get("role") == "user"] or messages
    content = user[-1].get("content") or ""
    if isinstance(content, list):  # OpenAI content parts
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return content


def judge_prompt(question: str, reference: str | None, answer: str) -> str:
    ref = "" if reference is None else f"Reference answer: {reference}\n\n"
    return (f"Problem:\n{question}\n\n{ref}Candidate answer: {answer}\n\n"
            "Is the candidate answer a correct final answer to the problem"
            f"{' (equivalent to the reference answer)' if reference is not None else ''}? "
            "Answer with one word: yes or no.")


def parse_verdict(reply: str | None) -> int | None:
    """1 for yes, 0 for no, None when the reply says neither or both (after any <think> block)."""
    words = re.findall(r"[a-z]+", _THINK.sub("", reply or "").lower())
    if words and words[0] in ("yes", "no"):
        return int(words[0] == "yes")
    said = {w for w in words if w in ("yes", "no")}
    return int("yes" in said) if len(said) == 1 else None


class Judge:
    """Cached, concurrent yes/no grading through an OpenAI-compatible chat endpoint."""

    def __init__(self, settings: JudgeSettings) -> None:
        import openai  # deferred: openai (only the judge label mode)
        self.settings = s = settings
        key = "EMPTY"  # local servers (vLLM, llama.cpp) accept any key; the client needs one
        if s.api_key_env:
            key = os.environ.get(s.api_key_env, "")
            if not key:
                raise JudgeError(f"judge: the environment variable {s.api_key_env} (its API key) "
                                 "is not set")
        self.client = openai.OpenAI(base_url=s.base_url, api_key=key, timeout=s.timeout,
                                    max_retries=s.max_retries)
        self._cache: dict[Key, int] = {}
        self.calls = 0  # requests that returned a reply (the check excluded)
        self.unparseable = 0
        self.example: str | None = None  # one unparseable reply, for the warning

    def check(self) -> None:
        """One trivial request, so an unusable endpoint fails before hours of generation."""
        self._run(lambda: self._ask("What is 1 + 1?", "2", "2"))

    def label(self, items: Sequence[Item]) -> list[list[int]]:
        """Raw per-step verdicts (0/1) for each (question, reference, step answers)."""
        todo: dict[Key, tuple[str, str | None, str]] = {}
        for q, ref, answers in items:
            for a in answers:
                if a is not None and (q, ref, normalise(a)) not in self._cache:
                    todo.setdefault((q, ref, normalise(a)), (q, ref, a))
        if todo:
            self._run(lambda: self._fetch(todo))
        return [[0 if a is None else self._cache[(q, ref, normalise(a))] for a in answers]
                for q, ref, answers in items]

    def counts(self) -> dict[str, int]:
        return {"judge_calls": self.calls, "judge_unparseable": self.unparseable}

    def _fetch(self, todo: dict[Key, tuple[str, str | None, str]]) -> None:
        pool = ThreadPoolExecutor(max_workers=self.settings.concurrency)
        try:
            futures = {pool.submit(self._ask, *args): key for key, args in todo.items()}
            for f in as_completed(futures):
                verdict, reply = f.result()
                self.calls += 1
                if verdict is None:
                    self.unparseable += 1
                    self.example = self.example if self.example is not None else reply
                self._cache[futures[f]] = verdict or 0
        finally:
            pool.shutdown(cancel_futures=True)  # after an error, send nothing more

    def _ask(self, question: str, reference: str | None, answer: str) -> tuple[int | None, str]:
        s = self.settings
        resp = self.client.chat.completions.create(
            model=s.model, temperature=0, max_tokens=s.max_tokens,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": judge_prompt(question, reference, answer)}])
        reply = (resp.choices[0].message.content or "") if resp.choices else ""
        return parse_verdict(reply), reply

    def _run(self, fn) -> None:
        """Run fn, turning the client's exceptions into one-line JudgeErrors."""
        import openai  # deferred: openai (only the judge label mode)
        try:
            fn()
        except openai.OpenAIError as e:
            raise JudgeError(self._describe(e)) from None

    def _describe(self, e: Exception) -> str:
        import openai  # deferred: openai (only the judge label mode)
        where, s = f"judge endpoint {self.settings.base_url}", self.settings
        if isinstance(e, openai.APIConnectionError):  # refused, DNS, timeout
            cause = f" ({e.__cause__})" if e.__cause__ else ""
            msg = f"{where} is unreachable: {e}{cause}"
        elif isinstance(e, (openai.AuthenticationError, openai.PermissionDeniedError)):
            hint = (f"check the key in ${s.api_key_env}" if s.api_key_env
                    else "pass the name of the variable holding the key (api_key_env)")
            msg = f"{where} refused the API key (HTTP {e.status_code}); {hint}"
        elif isinstance(e, openai.NotFoundError):
            msg = (f"{where} answered 404 ({e.message}); is the model {s.model!r} served there and "
                   "does the URL end in /v1?")
        elif isinstance(e, openai.APIStatusError):
            msg = f"{where} answered HTTP {e.status_code}: {e.message}"
        else:
            msg = f"{where}: {e}"
        return " ".join(msg.split())[:500]
