"""The lm-evaluation-harness command with our checkpoints as model "jaxpt" (model/evals/harness.py).

    python scripts/run_lm_eval.py --model jaxpt --model_args run_dir=runs/tiny_sample,step=300 \
        --tasks lambada_openai,hellaswag --batch_size 1
    python scripts/run_lm_eval.py --model jaxpt --model_args run_dir=runs/tiny_sample \
        --tasks my_task --include_path configs/eval/lm_eval_tasks     # local task YAMLs, no hub

Every argument is lm_eval's (`lm_eval --help`). The wrapper exists because the `lm_eval`
command discovers only the models inside its own package: importing model.evals.harness first
registers ours, beside the harness's own models (`--model hf ...` works as with `lm_eval`).
(Not named lm_eval.py: the script's directory comes first on sys.path and would shadow the
package.) Needs the [eval] extra (pip install -e ".[eval]").
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    from model.runtime.distributed import quiet_cpu_start

    quiet_cpu_start()   # no libtpu warnings on a machine without a TPU (JAX_PLATFORMS, if set, wins)
    from lm_eval.__main__ import cli_evaluate

    import model.evals.harness  # noqa: F401  (registers "jaxpt")

    cli_evaluate()


if __name__ == "__main__":
    main()
