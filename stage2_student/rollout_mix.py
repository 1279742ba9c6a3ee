"""On-policy rollouts mixed with an off-policy corpus cache, GKD's lambda: which stream each micro-batch reads.

`xtcache train-student --cache ROLLOUTS --corpus-cache CORPUS --rollout-fraction 0.5` trains a fraction
lambda (`--rollout-fraction`) of the micro-batches on the rollout cache, the others on the corpus cache
(Agarwal et al. 2024 draw each batch on-policy with probability lambda). The schedule is stratified, not
drawn (`draws_rollout`): any n consecutive micro-batches of a rank hold lambda n rollout micro-batches,
rounded up or down, and so do the ranks' micro-batches of one optimizer step together, so a short run (a
round of a few steps) trains the share it asks for (independent draws of probability 0.5 gave 0 of a round's
4 micro-batches to the rollouts on the demo's seed, and 2 to 5 of 8 on the converged bench's seeds), and every
rank reads its share of both caches. Only the phase comes from the seed (and the rank). The schedule is a pure
function of (seed, rank, world size, the rank's micro-batch index), so the mixture is the same on every run,
whatever the number of DataLoader workers, and a resumed run reads exactly the micro-batches an uninterrupted
one would have (each stream keeps its own `CacheLoader` position). A run started with `--init-from` a checkpoint
that read the same corpus cache on the same ranks (the next round of `xtcache rounds`) continues the corpus stream
where that run left it (`continue_corpus`): rounds do not train the corpus's first micro-batches over and over.
With `--corpus-loss ce` or `auto` each corpus micro-batch carries `CORPUS_OBJECTIVE_KEY`, and the trainer trains it
with the corpus objective (`StageData.corpus_objective`) where the rollouts train the run's: CE alone at weight 1
(ce: the micro-batch comes without its teacher keys, so it counts no chunk and the step's KD is normalised by the
rollouts' chunks alone), or train-student's defaults for the corpus cache (auto: the loss divides both KD sums by
all the step's chunks; the step's metrics report them apart, `kd` and `corpus_kd`).

    train = MixedLoader(CacheLoader(rollouts), CacheLoader(corpus), fraction=0.5, seed=0)
"""

from __future__ import annotations

import hashlib
import logging
import math

from stage2_student.join import student_view
from xtcache.errors import ConfigError

log = logging.getLogger(__name__)

CORPUS_OBJECTIVE_KEY = "corpus_objective"  # the micro-batch trains StageData.corpus_objective (--corpus-loss ce, auto)


def corpus_batch(batch: dict, corpus_loss: str) -> dict:
    """A corpus micro-batch as `--corpus-loss` trains it: as it is, on the run's objective (kd), or marked for the
    corpus objective (auto; ce also drops the teacher keys, which its CE-only objective does not read, a joined
    batch's teacher count and chunk groups with them)."""
    if corpus_loss == "kd":
        return batch
    if corpus_loss == "ce":
        batch = {k: v for k, v in student_view(batch).items() if k not in ("num_groups", "num_teachers")}
    return {**batch, CORPUS_OBJECTIVE_KEY: True}


SCHEDULE = "stratified"  # recorded in a mixed stream's state: a checkpoint of another schedule does not resume


def draws_rollout(seed: int, j: int, fraction: float, *, rank: int = 0, world_size: int = 1) -> bool:
    """Whether a rank's j-th micro-batch reads the rollouts: when floor((j + 1) f + v) > floor(j f + v), f the
    fraction and v = u + rank / world_size, u the seed's phase (sha256 of it read as a number in [0, 1)).

    Each rank's micro-batches 0 to n - 1 hold floor(n f + v) - floor(v) rollout micro-batches, n f rounded up or
    down, so every rank reads both of its shares in proportion (each stream of a rank reads that rank's share of
    its cache). Summed over the ranks, floor(x + r / W) adds up to floor(W x) (Hermite's identity), so the ranks'
    micro-batches j0 to j1 - 1 together hold W (j1 - j0) f of them, rounded: every optimizer step holds its share."""
    if fraction >= 1.0:
        return True
    digest = hashlib.sha256(f"xtcache-rollout-mix:{seed}".encode()).digest()
    v = int.from_bytes(digest[:8], "big") / 2**64 + rank / world_size
    return math.floor((j + 1) * fraction + v) > math.floor(j * fraction + v)


class MixedLoader:
    """This rank's micro-batches, each from the rollout or the corpus stream (`draws_rollout`), resumable.

    The schedule (`draws_rollout`) picks the stream of rank r's j-th micro-batch, and that stream's next
    micro-batch is yielded. `state_dict()` holds the micro-batches consumed, the schedule and both streams'
    states; the stream of a micro-batch depends on the rank layout, so a mixed stream resumes on the same
    ranks x --grad-accum only (`loader.reshard_state` refuses).
    """

    def __init__(self, rollouts, corpus, *, fraction: float, seed: int, corpus_loss: str = "kd"):
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"--rollout-fraction {fraction}: must lie in (0, 1]")
        self.rollouts, self.corpus, self.fraction, self.seed = rollouts, corpus, float(fraction), int(seed)
        self.corpus_loss = corpus_loss  # --corpus-loss: kd (the run's objective), auto (the corpus's) or ce
        self.consumed = 0

    @property
    def dataset(self):
        """The rollout stream's dataset (what the run describes as its training data)."""
        return self.rollouts.dataset

    def __len__(self) -> int:
        return len(self.rollouts)

    def source(self, j: int) -> str:
        """'rollouts' or 'corpus': the stream of this rank's j-th micro-batch."""
        d = self.rollouts.dataset
        return "rollouts" if draws_rollout(self.seed, j, self.fraction, rank=d.rank, world_size=d.world_size) \
            else "corpus"

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
            yield corpus_batch(batch, self.corpus_loss) if name == "corpus" else batch

    def state_dict(self) -> dict:
        return {"mixture": {"consumed": self.consumed, "fraction": self.fraction, "seed": self.seed,
                            "corpus_loss": self.corpus_loss, "schedule": SCHEDULE},
                "rollouts": self.rollouts.state_dict(), "corpus": self.corpus.state_dict()}

    def continue_corpus(self, state: dict | None, ckpt) -> bool:
        """Continue the corpus stream where the checkpoint `ckpt` (an --init-from) left it: `state` is its loader
        state on this rank (None: saved on another number of ranks), a mixed stream's (its corpus) or an unmixed
        one's (its --cache). Only the same cache (cache key, windows) read with the same seed and rank layout
        continues; otherwise the stream starts at its beginning. The rollout stream and the schedule start at their
        beginnings either way (another run's cache). Logged."""
        if state is None:
            log.info("--corpus-cache: its stream starts at its beginning (--init-from %s was saved on another number "
                     "of ranks)", ckpt)
            return False
        was = state.get("corpus") if "mixture" in state else state
        if was is None or was.get("caches") != self.corpus.dataset.cache_keys:  # none: before caches were recorded
            log.info("--corpus-cache: its stream starts at its beginning (--init-from %s did not read that cache)",
                     ckpt)
            return False
        if diff := self.corpus.differences(was):
            log.info("--corpus-cache: its stream starts at its beginning (--init-from %s read it with other settings: "
                     "%s)", ckpt, ", ".join(diff))
            return False
        self.corpus.load_state_dict(was)
        log.info("--corpus-cache: its stream continues where --init-from %s left it (epoch %d, micro-batch %d)",
                 ckpt, self.corpus.epoch, self.corpus.consumed)
        return True

    def load_state_dict(self, state: dict) -> None:
        mix = state.get("mixture")
        if mix is None or mix["fraction"] != self.fraction or mix["seed"] != self.seed:
            was = "an unmixed stream" if mix is None else f"--rollout-fraction {mix['fraction']}, --seed {mix['seed']}"
            raise ConfigError(f"cannot resume the data stream: the checkpoint has {was}, this run "
                              f"--rollout-fraction {self.fraction}, --seed {self.seed}; resume with the settings of "
                              "the interrupted run")
        if mix.get("schedule") != SCHEDULE:  # before it: an independent draw per global micro-batch
            raise ConfigError("cannot resume the data stream: the checkpoint's micro-batches were drawn from the "
                              "rollouts and the corpus independently (an xtcache before the stratified schedule of "
                              "2026-12-01); resume it with that xtcache, or start from the checkpoint with "
                              "--init-from")
        was = mix.get("corpus_loss")  # recorded with the schedule
        if was != self.corpus_loss:  # the stream is the same; the corpus micro-batches' loss is a choice, logged
            log.warning("resuming with --corpus-loss %s on a checkpoint trained with --corpus-loss %s",
                        self.corpus_loss, was)
        self.rollouts.load_state_dict(state["rollouts"])
        self.corpus.load_state_dict(state["corpus"])
        self.consumed = int(mix["consumed"])
