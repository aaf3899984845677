"""Sample text from a checkpoint with a KV cache.

    python scripts/generate.py --checkpoint runs/tiny_sample --prompt "Once upon a time" \
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 0

--checkpoint: a run directory (its latest checkpoint), a checkpoint directory (its latest step)
or one step directory (runs/x/checkpoints/200). The tokenizer is the run's (the checkpoint's
meta holds the resolved config, with an absolute tokenizer.path). --temperature 0 is greedy.

How: the prompt is prefilled in one call, then each new token is one call of the same jitted
step on a fixed-size cache (Llama.decode in model/llama.py), so nothing is recomputed and the
step compiles once. Generation stops at the tokenizer's end-of-sequence token, which the
training data puts between documents.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time


def sample_logits(logits_bv, key, temperature: float, top_p: float, n_valid: int):
    """Next tokens [b]: argmax when temperature == 0, else nucleus sampling at `temperature`.

    Ids >= n_valid (vocabulary padding beyond the tokenizer) are never produced. top-p keeps
    the most likely tokens until their mass reaches top_p (at least one token).
    """
    import jax
    import jax.numpy as jnp

    v = logits_bv.shape[-1]
    logits_bv = jnp.where(jnp.arange(v) < n_valid, logits_bv.astype(jnp.float32), -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / temperature
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        cutoff_b1 = jnp.min(jnp.where(mass_before_bv < top_p, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        logits_bv = jnp.where(logits_bv >= cutoff_b1, logits_bv, -jnp.inf)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def make_step(cfg, temperature: float, top_p: float, n_valid: int):
    """jitted (params, tokens_bt, cache, key) -> (next tokens [b], cache); the cache is donated.

    One function for prefill (t = prompt length) and decode (t = 1): it compiles once per shape.
    """
    import jax
    import jax.numpy as jnp

    from model.step import model_from_params

    def step(params, tokens_bt, cache, key):
        model = model_from_params(cfg, params)
        b, t = tokens_bt.shape
        positions_bt = jnp.broadcast_to(cache["length"] + jnp.arange(t, dtype=jnp.int32), (b, t))
        logits_btv, cache = model.decode(tokens_bt, positions_bt, cache)
        return sample_logits(logits_btv[:, -1], key, temperature, top_p, n_valid), cache

    return jax.jit(step, donate_argnums=(2,))


def generate(cfg, params, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, eos_id: int | None = None, n_valid: int | None = None) -> list[int]:
    """The continuation (new token ids, EOS excluded) of one prompt."""
    import jax
    import jax.numpy as jnp

    from model.step import model_from_params

    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    max_len = len(prompt_ids) + max_new_tokens
    if max_len > cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's max_seq_len={cfg.max_seq_len}")
    step = make_step(cfg, temperature, top_p, n_valid or cfg.vocab_size)
    cache = model_from_params(cfg, params).init_cache(1, max_len)
    key = jax.random.key(seed)
    tokens_bt = jnp.asarray([prompt_ids], jnp.int32)
    out: list[int] = []
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        next_b, cache = step(params, tokens_bt, cache, sub)
        token = int(next_b[0])
        if token == eos_id:
            break
        out.append(token)
        tokens_bt = next_b[:, None]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir, or step dir")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's model.dtype)")
    args = ap.parse_args(argv)
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()       # before JAX starts: no libtpu warnings where no TPU can be
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.max_new_tokens < 1:
        ap.error("need --temperature >= 0, 0 < --top-p <= 1, --max-new-tokens >= 1")

    from data.tokenizer import load_tokenizer, special_ids
    from model.runtime.checkpoint import load_params

    overrides = {"dtype": args.dtype} if args.dtype else {}
    cfg, params, meta = load_params(args.checkpoint, **overrides)
    run_cfg = meta.get("config") or {}
    tok_path = (run_cfg.get("tokenizer") or {}).get("path")
    if not tok_path:
        raise SystemExit(f"{args.checkpoint}: the checkpoint's meta names no tokenizer.path")
    tok = load_tokenizer(tok_path)
    eos_id, bos_id = special_ids(tok)
    prompt_ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if (run_cfg.get("data") or {}).get("add_bos") and bos_id is not None:
        prompt_ids = [bos_id] + prompt_ids  # as the model saw documents start in training

    t0 = time.perf_counter()
    new_ids = generate(cfg, params, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, eos_id=eos_id, n_valid=tok.get_vocab_size())
    dt = time.perf_counter() - t0
    print(f"# {meta['directory']}/{meta['step']}: {len(prompt_ids)} prompt + {len(new_ids)} new tokens "
          f"in {dt:.1f} s (incl. compile)", file=sys.stderr)
    # Decoding prompt + continuation together keeps byte-level pieces that span the seam intact.
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + new_ids, skip_special_tokens=True)
    continuation = full[len(prompt_text):] if full.startswith(prompt_text) else tok.decode(new_ids)
    print(args.prompt + continuation)


if __name__ == "__main__":
    main()
