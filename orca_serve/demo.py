"""`make demo`: serve the embedded toy reasoner, ask it one question, show what ORCA did.

Starts `orca-serve --demo` on a free local port, sends the same chat request twice with the
OpenAI client (greedy): once in shadow mode (ORCA scores but never stops: the full reasoning)
and once with early stopping, prints both, then stops the server.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

QUESTION = "Find the integer x with 7*x + 3 = 52."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"orca-serve exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"orca-serve did not answer {url}/health within {timeout:.0f} s")


def _ask(client, question: str, policy: str, delta: float | None):
    orca = {"policy": policy} | ({"delta": delta} if delta is not None else {})
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=512,
        messages=[{"role": "user", "content": question}], extra_body={"orca": orca})


def paragraphs(text: str) -> int:
    """Reasoning steps as printed: paragraphs separated by blank lines (the bundle's `\n\n`)."""
    return sum(1 for p in text.split("\n\n") if p.strip())


def _show(title: str, resp) -> tuple[dict, int]:
    """Print one response; return its `orca` object and how many reasoning steps it printed."""
    msg = resp.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None) or getattr(msg, "reasoning", None) or ""
    orca = (resp.model_extra or {}).get("orca") or {}
    print(f"\n=== {title} ===")
    print("--- reasoning ---")
    print(reasoning.strip())
    print("--- answer ---")
    print((msg.content or "").strip())
    print(f"--- orca: {orca}")
    return orca, paragraphs(reasoning)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--delta", type=float, help="risk level (default: the bundle's)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the server")
    a = ap.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    # eager: a tiny model gains nothing from torch.compile, whose first start takes longer
    cmd = [sys.executable, "-m", "orca_serve.serve_cli", "--demo", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port)]
    print(f"starting: {' '.join(cmd)}  (first start compiles nothing: eager mode; ~1 min)")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_healthy(url, proc, a.timeout)
        from openai import OpenAI  # deferred: openai (not needed by --help)
        client = OpenAI(base_url=f"{url}/v1", api_key="demo")
        full, total = _show("without early stopping (shadow: ORCA scores, never stops)",
                            _ask(client, a.question, "shadow", a.delta))
        early, _ = _show("with ORCA early stopping", _ask(client, a.question, "answer", a.delta))
        print("\n=== what ORCA did ===")
        if early.get("stopped_early"):
            saved = (full.get("reasoning_tokens") or 0) - (early.get("reasoning_tokens") or 0)
            # Steps are the paragraphs printed above. The probe scores a step when a blank line
            # ends it, so the full reasoning's last paragraph (ended by </think>) is not scored.
            print(f"stopped after reasoning step {early.get('stop_step')} of the {total} the full "
                  f"reasoning has (delta={early.get('delta')}, lambda*={early.get('lambda')}); "
                  f"reasoning tokens {early.get('reasoning_tokens')} instead of "
                  f"{full.get('reasoning_tokens')}: {saved} saved")
        else:
            print(f"did not stop early: the smoothed score stayed below lambda*="
                  f"{early.get('lambda')} over {early.get('steps_scored')} steps "
                  f"(delta={early.get('delta')}); the guarantee allows no earlier stop here")
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode not in (0, -15, None) and err:
            print(err[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
