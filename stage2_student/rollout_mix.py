"""On-policy rollouts mixed with an off-policy corpus cache, GKD's lambda: which stream each micro-batch reads.

`xtcache train-student --cache ROLLOUTS --corpus-cache CORPUS --rollout-fraction 0.5` trains a fraction
lambda (`--rollout-fraction`) of the micro-batches on the rollout cache, the others on the corpus cache
(Agarwal et al. 2024 draw each batch on-policy with probability lambda). The schedule is stratified, not
drawn: any n consecutive global micro-batches hold lambda n rollout micro-batches, rounded up or down, so a
short run (a round of a few steps) trains the share it asks for (independent draws of probability 0.5 gave 0
of a round's 4 micro-batches to the rollouts on the demo's seed, and 2 to 5 of 8 on the converged bench's
seeds). Only the phase comes from the seed. The schedule is a pure function of (seed, global micro-batch
index), so the mixture is the same on every run, whatever the number of DataLoader workers, and a resumed
run reads exactly the micro-batches an uninterrupted one would have (each stream keeps its own `CacheLoader`
position). With `--corpus-loss ce` each corpus
micro-batch leaves its teacher keys behind (`ce_only`): the objective trains cross-entropy on its text
alone, at `CORPUS_CE_WEIGHT`, and the step's KD is normalised by the rollouts' chunks only.

    train = MixedLoader(CacheLoader(rollouts), CacheLoader(corpus), fraction=0.5, seed=0)
"""

from __future__ import annotations

import hashlib
import logging
import math

from stage2_student.join import CE_ONLY_KEY, student_view
from stage2_student.order import global_micro_batch
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

CORPUS_CE_WEIGHT = 1.0  # --corpus-loss ce: the weight of CE on the corpus text, as `--loss ce` trains it


def ce_only(batch: dict) -> dict:
    """A micro-batch without its teacher: CE on its labelled tokens at CORPUS_CE_WEIGHT (`Prepared.ce_weight`).
    A joined batch's teacher count and chunk groups go too (`TeacherMix.counts` would read its groups)."""
    student = {k: v for k, v in student_view(batch).items() if k not in ("num_groups", "num_teachers")}
    return {**student, "num_chunks": 0, CE_ONLY_KEY: CORPUS_CE_WEIGHT}


def draws_rollout(seed: int, g: int, fraction: float) -> bool:
    """Whether global micro-batch g reads the rollouts: when floor((g + 1) f + u) > floor(g f + u), f the
    fraction and u the seed's phase (sha256 of it read as a number in [0, 1)). Micro-batches 0 to n - 1 then
    hold floor(n f + u) - floor(u) rollout micro-batches: n f rounded up or down."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(f"xtcache-rollout-mix:{seed}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return math.floor((g + 1) * fraction + u) > math.floor(g * fraction + u)


class MixedLoader:
    """This rank's micro-batches, each from the rollout or the corpus stream (`draws_rollout`), resumable.

    Rank r's j-th micro-batch is global micro-batch `global_micro_batch(j, ...)`; its draw picks the
    stream, and that stream's next micro-batch is yielded. `state_dict()` holds the micro-batches
    consumed and both streams' states; the stream of a global micro-batch depends on the rank layout,
    so a mixed stream resumes on the same ranks x --grad-accum only (`loader.reshard_state` refuses).
    """

    def __init__(self, rollouts, corpus, *, fraction: float, seed: int, corpus_ce_only: bool = False):
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"--rollout-fraction {fraction}: must lie in (0, 1]")
        self.rollouts, self.corpus, self.fraction, self.seed = rollouts, corpus, float(fraction), int(seed)
        self.corpus_ce_only = corpus_ce_only  # --corpus-loss ce: its micro-batches train CE alone
        self.consumed = 0

    @property
    def corpus_loss(self) -> str:
        return "ce" if self.corpus_ce_only else "kd"

    @property
    def dataset(self):
        """The rollout stream's dataset (what the run describes as its training data)."""
        return self.rollouts.dataset

    def __len__(self) -> int:
        return len(self.rollouts)

    def source(self, j: int) -> str:
        """'rollouts' or 'corpus': the stream of this rank's j-th micro-batch."""
        d = self.rollouts.dataset
        g = global_micro_batch(j, rank=d.rank, world_size=d.world_size, grad_accum=d.grad_accum)
        return "rollouts" if draws_rollout(self.seed, g, self.fraction) else "corpus"

    def __iter__(self):
        streams = {}  # started on first use: an unused stream starts no workers
        loaders = {"rollouts": self.rollouts, "corpus": self.corpus}
        while True:
            name = self.source(self.consumed)
            if name not in streams:
                streams[name] = iter(loaders[name])
            try:
                batch = next(streams[name])
            except StopIteration:
                return
            self.consumed += 1
            yield ce_only(batch) if name == "corpus" and self.corpus_ce_only else batch

    def state_dict(self) -> dict:
        return {"mixture": {"consumed": self.consumed, "fraction": self.fraction, "seed": self.seed,
                            "corpus_loss": self.corpus_loss},
                "rollouts": self.rollouts.state_dict(), "corpus": self.corpus.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        mix = state.get("mixture")
        if mix is None or mix["fraction"] != self.fraction or mix["seed"] != self.seed:
            was = "an unmixed stream" if mix is None else f"--rollout-fraction {mix['fraction']}, --seed {mix['seed']}"
            raise ConfigError(f"cannot resume the data stream: the checkpoint has {was}, this run "
                              f"--rollout-fraction {self.fraction}, --seed {self.seed}; resume with the settings of "
                              "the interrupted run")
        was = mix.get("corpus_loss", "kd")  # recorded since --corpus-loss existed; before it, kd
        if was != self.corpus_loss:  # the stream is the same; the corpus micro-batches' loss is a choice, logged
            log.warning("resuming with --corpus-loss %s on a checkpoint trained with --corpus-loss %s",
                        self.corpus_loss, was)
        self.rollouts.load_state_dict(state["rollouts"])
        self.corpus.load_state_dict(state["corpus"])
        self.consumed = int(mix["consumed"])
