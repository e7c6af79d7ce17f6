"""Peak memory of one update with and without chunked log-probs (train.logprob_chunk_tokens).

One ppo_update of SmolLM2-135M-Instruct (fp32, vocabulary 49,152) on 8 responses x 1,024
tokens after a 64-token prompt, one micro-batch of 8, every prompt recomputed
(share_prefix off), advantages +1 and -0.5 (a loss of -0.25). Each setting runs in its own
process, which reports its peak RSS (``ru_maxrss``) and the update's wall time:

* ``whole``: ``logprob_chunk_tokens`` = 8,192, the micro-batch in one chunk: the (8, 1,024,
  49,152) logits exist at once, as the update computed them before the chunks (1.6 GB a copy);
* ``chunked``: the default, 1,024 tokens (128 positions x 8 rows) a chunk, each chunk's logits
  recomputed in backward.

Both take the same step (their losses and gradient norms are printed). Needs the embedded model
(``atgrpo models prepare``).

    .venv/bin/python bench/bench_logprob_memory.py [--responses 8] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SETTINGS = {"whole": 8192, "chunked": None}  # None: the config's default


def run_one(chunk: int | None, responses: int, tokens: int) -> dict[str, float]:
    """One update in this process; its figures."""
    import dataclasses

    import torch

    from atgrpo.algo.records import Sample
    from atgrpo.algo.update import ppo_update
    from atgrpo.config import load_config
    from atgrpo.policies import build_policy
    from atgrpo.training.settings import update_settings

    overrides = ["model.precision=fp32", f"train.micro_batch_size={responses}"]
    cfg = load_config(None, overrides)
    policy = build_policy(cfg)
    settings = dataclasses.replace(update_settings(cfg), share_prefix=False)
    if chunk is not None:
        settings = dataclasses.replace(settings, logprob_chunk_tokens=chunk)
    generator = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    prompt = torch.randint(vocab, (64,), generator=generator).tolist()
    samples = [
        Sample(0, 0, "a", 0, k, policy.policy_id, prompt,
               torch.randint(vocab, (tokens,), generator=generator).tolist(), [-1.0] * tokens,
               0.0, 0.0, 0.0, True, advantage=1.0 if k % 2 else -0.5)
        for k in range(responses)
    ]  # fmt: skip
    start = time.perf_counter()
    stats = ppo_update(policy, samples, settings)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "chunk_tokens": float(settings.logprob_chunk_tokens),
        "peak_rss_gib": peak_kib / 2**20,
        "update_s": seconds,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "skipped": float(stats.skipped),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--one", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(SETTINGS[args.one], args.responses, args.tokens)))
        return
    rows = {}
    for name in SETTINGS:  # each in a fresh process: ru_maxrss is a process's peak
        cmd = [sys.executable, __file__, "--one", name]
        cmd += ["--responses", str(args.responses), "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
        print(name, json.dumps(rows[name]), flush=True)
    whole, chunked = rows["whole"], rows["chunked"]
    ratio = chunked["peak_rss_gib"] / whole["peak_rss_gib"]
    print(
        f"{args.responses} x {args.tokens} tokens: peak RSS {whole['peak_rss_gib']:.2f} -> "
        f"{chunked['peak_rss_gib']:.2f} GiB ({ratio:.2f}x), "
        f"update {whole['update_s']:.1f} -> {chunked['update_s']:.1f} s, "
        f"loss {whole['loss']:.6f} / {chunked['loss']:.6f}, "
        f"gradient norm {whole['grad_norm']:.6f} / {chunked['grad_norm']:.6f}"
    )


if __name__ == "__main__":
    main()
