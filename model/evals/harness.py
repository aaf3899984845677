"""lm-evaluation-harness model "jaxpt": any checkpoint of ours through the harness's whole task
catalogue, on whatever devices JAX sees, without exporting weights (extra: pip install -e ".[eval]").

    python scripts/run_lm_eval.py --model jaxpt --model_args run_dir=runs/tiny_sample,step=300 \
        --tasks hellaswag --include_path my_tasks/        # lm_eval's own CLI, our model registered
    import model.evals.harness, lm_eval
    lm_eval.simple_evaluate(model="jaxpt", model_args="run_dir=runs/tiny_sample", tasks=[...])

The harness's `lm_eval` command has no plugin hook for models outside its package, so
scripts/run_lm_eval.py imports this module (which registers "jaxpt") and then runs that command.

Tokenization is the harness's own (TemplateLM: `_encode_pair`, the prefix token for an empty
context); scoring is model/evals/evaluate.py's Scorer, the in-loop evaluator's engine: requests packed
into fixed-shape rows over a data-parallel mesh of all devices. The log-likelihoods equal those
of the exported Hugging Face model through the harness's HF backend (tests/test_lm_eval.py).
"""
from __future__ import annotations

import logging
import os

try:
    # lm_eval.models first: it fills the registry with the harness's own models (lazy entries, no
    # backend imported). get_model() does that only while the registry is empty, so registering
    # "jaxpt" into an empty one would hide "hf", "vllm", "dummy"... from the same process.
    import lm_eval.models  # noqa: F401
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"model/evals/harness.py needs lm-evaluation-harness: pip install -e \".[eval]\" ({e})") from None

log = logging.getLogger(__name__)

# Data parallel over every device: the adapter's mesh. Parameters are replicated (a checkpoint
# that needs FSDP to fit is evaluated in-loop, on the run's own mesh).
_MESH = {"data": -1, "fsdp": 1, "tensor": 1,
         "rules": [[name, None] for name in ("vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", "layers",
                                             "act_len", "act_embed", "act_mlp", "act_heads", "act_kv_heads",
                                             "act_vocab")] + [["act_batch", ["data"]]]}


@register_model("jaxpt")
class JaxptLM(TemplateLM):
    """run_dir: a run directory (its latest checkpoint), a checkpoint directory or a step directory;
    step: a step of that run (default: the latest); batch_rows: packed rows per scoring step
    (rounded up to the device count); seq_len: tokens per row (default: the model's max_seq_len);
    dtype: compute dtype (default float32, the reference numerics)."""

    def __init__(self, run_dir: str, step: int | None = None, batch_rows: int = 8, seq_len: int | None = None,
                 dtype: str = "float32", **harness_kwargs):
        super().__init__()
        import jax

        from data.tokenizer import load_tokenizer, special_ids
        from model import sharding as shd
        from model.evals.evaluate import Scorer
        from model.runtime.checkpoint import load_params
        from model.step import param_shardings

        ignored = {k: v for k, v in harness_kwargs.items() if v is not None and k not in ("batch_size", "device",
                                                                                            "max_batch_size")}
        if ignored:
            raise ValueError(f"jaxpt: unknown model_args {sorted(ignored)}; expected run_dir, step, batch_rows, "
                             "seq_len, dtype")
        path = run_dir if step is None else _step_dir(run_dir, int(step))
        cfg, params, meta = load_params(path, host=True, dtype=dtype, remat="none")   # sharded below
        run_cfg = meta.get("config") or {}
        tok_path = (run_cfg.get("tokenizer") or {}).get("path")
        if not tok_path:
            raise ValueError(f"{path}: the checkpoint's meta names no tokenizer.path")
        self.tok = load_tokenizer(tok_path)
        self.eos_id, bos_id = special_ids(self.tok)
        self._prefix_id = bos_id if bos_id is not None else self.eos_id
        # Training put BOS before every document: encode as the exported tokenizer's template does.
        self._bos = bos_id if (run_cfg.get("data") or {}).get("add_bos") else None
        mesh = shd.make_mesh(_MESH)
        rules = shd.rules_from_cfg(_MESH)
        shardings = param_shardings(cfg, mesh, rules)
        self.params = jax.device_put(params, shardings)
        ways = mesh.shape["data"]
        self.scorer = Scorer(cfg, mesh, rules, shardings, seq_len=int(seq_len or cfg.max_seq_len),
                             batch_rows=-(-int(batch_rows) // ways) * ways)
        self.checkpoint = f"{meta['directory']}/{meta['step']}"
        log.info("jaxpt: %s (%d parameters) on %d devices", self.checkpoint, cfg.num_params(), ways)

    # ---- what TemplateLM asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix_id

    @property
    def max_length(self) -> int:
        return self.scorer.seq_len

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tok.encode(string).ids
        return [self._bos] + ids if self._bos is not None and add_special_tokens is not False else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        from model.evals.tasks import Request

        reqs = [Request(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        if not reqs:
            return []
        ll, greedy = self.scorer.score(self.params, reqs)
        out = [(float(a), bool(b)) for a, b in zip(ll, greedy, strict=True)]
        for (key, _, _), res in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks (wikitext...): the harness's rolling windows of max_length tokens, each
        scored as a (context, continuation) token request; a document's windows summed."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, req in enumerate(requests):
            (string,) = req.args
            for w in get_rolling_token_windows(token_list=self.tok_encode(string, add_special_tokens=False),
                                               prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                                               context_len=1):
                windows.append((None, *make_disjoint_window(w)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("jaxpt scores loglikelihood, multiple-choice and perplexity tasks; generation "
                                  "tasks (generate_until) are not implemented: export with scripts/export_hf.py "
                                  "and use --model hf for those")


def _step_dir(run_dir: str, step: int) -> str:
    from model.runtime.checkpoint import resolve_checkpoint

    directory, latest = resolve_checkpoint(run_dir)
    path = os.path.join(directory, str(step))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{run_dir}: no checkpoint at step {step} (latest is {latest})")
    return path
