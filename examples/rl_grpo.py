"""GRPO on a tiny local model with a verifiable reward (reply in exactly N words), on tpuray.rl.

    python examples/rl_grpo.py                       # rollout engine in this process (CPU)
    python examples/rl_grpo.py --slice               # rollout engine TP=2 on an emulated v6e 2x2 slice
    python examples/rl_grpo.py --colocate            # the engine sleeps (frees its memory) while training
    python examples/rl_grpo.py --trainer tpuray      # trainer: tpuray.train FSDP2 on a 2nd slice (RLRun)
    python examples/rl_grpo.py --trainer tpuray --overlap   # generate batch k+1 while training on k
    python examples/rl_grpo.py --trainer tpuray --colocate  # one slice: the engine in the trainer's workers
    python examples/rl_grpo.py --png reward.png      # and plot the mean reward per iteration

The loop (rollouts with logprobs -> reward -> group z-score advantages -> clipped policy steps -> weight
sync) lives in `tpuray.rl.grpo` (src/tpuray/rl/grpo.py), so that `tpuray demo --rl` runs the same code
from an installed package; read it there.
"""

from __future__ import annotations

from tpuray.rl.grpo import main

if __name__ == "__main__":
    main()
