"""`make demo`: serve the embedded toy reasoner, ask it one question, show what ORCA did.

Starts `orca-serve --demo` on a local port (`--port`, else a free one), sends the same chat request
twice with the OpenAI client (greedy): once in shadow mode (ORCA scores but never stops: the full
reasoning) and once with early stopping, prints both, then stops the server.

The server runs in its own session, and the demo stops that whole process group: vLLM's
EngineCore and workers are its children, and stopping only the API server would leave them
running. A server not healthy within `--wait` seconds ends the demo with one line that says so
and where the server's log is.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import NoReturn

import psutil

QUESTION = "Find the integer x with 7*x + 3 = 52."
WAIT_S = 300.0  # a loaded machine needs minutes; an idle one, about a minute
STOP_GRACE_S = 30.0  # SIGTERM's grace before SIGKILL, for the server's group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(msg: str) -> NoReturn:
    """End the demo with one line on stderr, exit code 1."""
    print(f"demo: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def server_command(port: int) -> list[str]:
    """The server the demo starts: `orca-serve --demo` on 127.0.0.1:`port`."""
    # eager: a tiny model gains nothing from torch.compile, whose first start takes longer
    return [sys.executable, "-m", "orca_serve.startup.cli", "--demo", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port)]


def start_server(port: int, log: str) -> subprocess.Popen:
    """`orca-serve --demo` on `port`, its output to the file `log` (a pipe nobody reads would
    block the server once full, and the engine's children would hold it open after a stop),
    in a session of its own so that `stop_server` can reach every process it starts."""
    env = {**os.environ,
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = server_command(port)
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"starting (pid {proc.pid}, log {log}): {' '.join(cmd)}", flush=True)
    return proc


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of group `pgid` still running. Zombies do not count: a member orphaned by
    the stop is re-parented to init or to the nearest subreaper, which may reap it late (a
    container's first process that is not an init never does), and a group of zombies would
    hold the stop for its whole grace."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def stop_server(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after `grace` seconds.
    Bounded: returns within `grace` + 10 s whatever the group does."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not group_members(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader: its exit code (a zombie counts as stopped already)
            if not group_members(proc.pid):
                break
            time.sleep(0.2)
    proc.poll()


def _wait_healthy(url: str, proc: subprocess.Popen, wait: float, log: str) -> None:
    deadline = time.monotonic() + wait
    while True:
        if proc.poll() is not None:
            fail(f"orca-serve exited with code {proc.returncode} before it was ready "
                 f"(its log: {log})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            fail(f"orca-serve was not healthy at {url}/health within {wait:g} s (a loaded "
                 f"machine may need more: --wait SECONDS); stopped it (its log: {log})")
        time.sleep(min(1.0, left))


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
    ap.add_argument("--wait", type=float, default=WAIT_S, metavar="SECONDS",
                    help=f"how long to wait for the server to be healthy (default {WAIT_S:g})")
    ap.add_argument("--port", type=int, default=0,
                    help="the server's port on 127.0.0.1 (default: a free one)")
    a = ap.parse_args()
    port = a.port or _free_port()
    url = f"http://127.0.0.1:{port}"
    fd, log = tempfile.mkstemp(prefix="orca-demo-", suffix=".log")
    os.close(fd)
    print(f"waiting up to {a.wait:g} s for the server (about a minute on an idle machine)")
    proc = start_server(port, log)
    try:
        _wait_healthy(url, proc, a.wait, log)
        _run(url, a.question, a.delta)
    finally:
        stop_server(proc)
    os.unlink(log)  # kept when the demo did not finish: the server's side of what went wrong


def _run(url: str, question: str, delta: float | None) -> None:
    """Ask twice (shadow, then early stopping) and say what ORCA did."""
    from openai import OpenAI  # deferred: openai (not needed by --help)

    client = OpenAI(base_url=f"{url}/v1", api_key="demo")
    full, total = _show("without early stopping (shadow: ORCA scores, never stops)",
                        _ask(client, question, "shadow", delta))
    early, _ = _show("with ORCA early stopping", _ask(client, question, "answer", delta))
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


if __name__ == "__main__":
    main()
