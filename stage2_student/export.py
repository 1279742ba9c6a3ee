"""The Hugging Face export of a stage 2 run: a plain `save_pretrained` directory with the tokenizer.

    export_hf(trainer, OUT / "hf")    # every rank calls it (ZeRO-3 gathers), rank 0 writes
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def export_hf(trainer, directory: Path) -> Path:
    """A consolidated `save_pretrained` directory (safetensors) loadable with plain transformers."""
    import torch.distributed as dist

    engine = trainer.engine
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if trainer.rank == 0 else None
    if trainer.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        engine.module.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        trainer.tokenizer.save_pretrained(str(directory))
        log.info("wrote Hugging Face model %s", directory)
    dist.barrier()
    return directory
