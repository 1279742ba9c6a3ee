"""From teacher logits (or final hidden states + the teacher's own lm_head) to what the store keeps.

`TeacherHead` loads the output projection of a Hugging Face causal LM from its safetensors (the
`lm_head.weight`, or the input embedding when the embeddings are tied) plus the logit scaling and
soft-capping its config asks for. `distill_targets` turns a block of logits into exactly the
arrays a `DocRecord` holds, vectorized in torch on the teacher's device, in row blocks so a
[rows, vocab] float32 matrix never exceeds `block_rows(V)` rows:

  topk     k most likely ids and their log-probs, residual = 1 - sum(exp(top-k log-probs))
  full     log-probs of every tokenizer id (k = V), residual = mass outside the tokenizer
  sampled  N draws at T=1 from the distribution restricted to the tokenizer's ids: unique ids
           sorted by count (descending), uint16 counts, 0 = padding; residual as in full mode
  headtail the top-k head as in topk mode (ids [:, :k], log-probs [n, k]), then N draws from the
           tokenizer's ids outside the head (the renormalised tail): unique ids by count (descending)
           in ids [:, k:], counts [n, width - k], padding id 0 count 0; residual = R, the tail mass
           the draws stand for (no draws where R = 0). The widths are `schemas.arrays.entry_widths`

Every mode also returns the log-prob of the realized next token. Log-probs are log-softmax over
all the model's logit columns. Checkpoints often pad the lm_head beyond the tokenizer (Qwen3:
151,936 columns, 151,669 tokens); ids >= len(tokenizer) are never emitted: those columns keep
their (normally negligible) probability in the normalizer and their mass is counted in the
residual, so the stored distribution is the model's own, not a renormalized one.

    python -c "from stage1_teacher.capture.head import TeacherHead; print(TeacherHead.load('teacher_dir', 'cpu'))"
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from schemas.arrays import entry_widths
from schemas.models import DRAWN_MODES, support_width
from xtcache import devices
from xtcache.errors import CaptureError

log = logging.getLogger(__name__)

# Architectures whose final hidden state times lm_head (+ the config's scaling) gives the logits.
# Others fall back to vLLM's own log-probs (logged as a warning).
HEAD_ARCHITECTURES = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM", "MixtralForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Phi3ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
    "OlmoForCausalLM",
}


class UnsupportedHead(CaptureError):
    """The teacher's output head cannot be reproduced from its hidden states (fall back)."""


@dataclass
class TeacherHead:
    """The teacher's output projection: logits = scale * (h @ weight.T), soft-capped if configured."""

    weight: "object"  # torch.Tensor [V_model, H]
    logit_scale: float = 1.0
    softcap: float | None = None
    architecture: str = ""

    @property
    def model_vocab(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    def load(cls, model_dir: str, device, dtype=None) -> "TeacherHead":
        import torch

        cfg = read_config(model_dir)
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in HEAD_ARCHITECTURES:
            raise UnsupportedHead(f"architecture {arch} has no known output head for the hidden-state path")
        text_cfg = cfg.get("text_config", cfg)
        tied = bool(cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", False)))
        weight = _find_tensor(model_dir, "lm_head.weight")
        if weight is None:
            embed = _find_tensor(model_dir, "model.embed_tokens.weight")
            if embed is None:
                embed = _find_tensor(model_dir, "model.language_model.embed_tokens.weight")
            if embed is not None and not tied:
                log.warning("teacher %s has no lm_head.weight and does not declare tied embeddings; "
                            "using the input embedding as the output head", model_dir)
            weight = embed
        if weight is None:
            raise UnsupportedHead(f"{model_dir}: no lm_head.weight or embedding in the safetensors files")
        scale = 1.0
        if arch.startswith("Cohere"):
            scale = float(text_cfg.get("logit_scale", 1.0))
        if arch == "GraniteForCausalLM":
            scale = 1.0 / float(text_cfg.get("logits_scaling", 1.0))
        softcap = text_cfg.get("final_logit_softcapping")
        weight = weight.to(device=device, dtype=dtype or torch.float32)
        return cls(weight=weight, logit_scale=scale, softcap=float(softcap) if softcap else None, architecture=arch)

    def to(self, device) -> "TeacherHead":
        """The same head with its weight on `device` (a no-op where it already is)."""
        return TeacherHead(weight=self.weight.to(device), logit_scale=self.logit_scale, softcap=self.softcap,
                           architecture=self.architecture)

    def logits(self, hidden):
        """float32 [N, V_model] logits from final hidden states [N, H] (any float dtype)."""
        import torch

        h = hidden.to(device=self.weight.device, dtype=self.weight.dtype)
        z = torch.matmul(h, self.weight.t()).float()
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def _find_tensor(model_dir: str, name: str):
    from safetensors import safe_open

    for path in weight_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            if name in set(f.keys()):
                return f.get_tensor(name)
    return None


HALF_DTYPES = ("bfloat16", "float16")


def resolved_dtype(model_dir: str, requested: str) -> str:
    """`--dtype` as the engines and the head run it. `auto`: the checkpoint's own half dtype; for a
    float32 checkpoint bfloat16 on CUDA (the head's matmul at tensor-core speed; the first-batch check
    derives its tolerance from it) and float32 on the CPU. Any other value is used as given, so
    `--dtype float32` is exact fp32 everywhere (no TF32)."""
    if requested != "auto":
        return requested
    cfg = read_config(model_dir)
    stored = str(cfg.get("torch_dtype") or cfg.get("dtype") or cfg.get("text_config", {}).get("torch_dtype") or "")
    if stored in HALF_DTYPES:
        return stored
    return "bfloat16" if devices.cuda_present() else "float32"


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CaptureError(f"--teacher {model_dir}: no config.json; pass a Hugging Face model directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def weight_files(model_dir: str) -> list[str]:
    """The teacher's safetensors files; CaptureError when it has none."""
    files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CaptureError(f"--teacher {model_dir}: no *.safetensors weights; xtcache loads safetensors only "
                           "(convert .bin checkpoints with save_pretrained(safe_serialization=True))")
    return files


@dataclass
class Targets:
    """Per-row arrays of one block of predictions (numpy, rows = predicted positions)."""

    ids: np.ndarray  # int32 [n, k]
    logprobs: np.ndarray | None  # float32 [n, k]
    counts: np.ndarray | None  # uint16 [n, k]
    residual: np.ndarray  # float32 [n]
    realized: np.ndarray  # float32 [n]


def sample_seed(seed: int, doc_hash: str, window: int) -> int:
    """Seed of one window's sampling stream: independent of batching, so resumed runs draw the same."""
    import hashlib

    h = hashlib.sha256(f"{seed}:{doc_hash}:{window}".encode()).digest()
    return int.from_bytes(h[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


BLOCK_ELEMENTS = 1 << 27  # at most this many float32 logits at once (512 MiB: 880 rows of a 152k vocabulary)
MAX_BLOCK_ROWS = 1024  # small blocks stay in cache; measured fastest on CPU


def block_rows(model_vocab: int) -> int:
    """Rows of [rows, V_model] float32 logits made at once: at most BLOCK_ELEMENTS, MAX_BLOCK_ROWS."""
    return max(16, min(MAX_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, model_vocab)))


def _split_logits(rows, head: "TeacherHead | None", V: int):
    """(real [r, V] contiguous, padded [r, V_model - V]) float32 logits of one block of rows."""
    import torch.nn.functional as F

    if head is None:
        z = rows.float()
        return z[:, :V].contiguous(), z[:, V:]
    h = rows.to(device=head.weight.device, dtype=head.weight.dtype)
    out = []
    for w in (head.weight[:V], head.weight[V:]):  # leading rows of a contiguous matrix: no copy
        z = F.linear(h, w).float()
        if head.logit_scale != 1.0:
            z = z * head.logit_scale
        if head.softcap:
            import torch

            z = torch.tanh(z / head.softcap) * head.softcap
        out.append(z)
    return out[0], out[1]


def distill_targets(rows, targets, *, mode: str, k: int, vocab_size: int, num_samples: int = 0,
                    generator=None, head: TeacherHead | None = None, rows_per_block: int | None = None) -> Targets:
    """Exact top-k / full / sampled / headtail targets for next tokens `targets` [n].

    `rows`: logits [n, V_model], or final hidden states [n, H] when the teacher's `head` is given
    (logits are then made block by block and never held for all rows). `vocab_size` is
    len(tokenizer): columns at or beyond it are never emitted (see module docstring). The
    normalizer is max + log(sum(exp(z - max))) over every column; the max comes free from the
    top-k, and small row blocks keep the [rows, V] matrix in cache.
    """
    import torch

    n = int(rows.shape[0])
    device = head.weight.device if head is not None else rows.device  # where the logits are made
    v_model = head.model_vocab if head is not None else int(rows.shape[1])
    V = min(vocab_size, v_model)
    rows_per_block = rows_per_block or block_rows(v_model)
    head_k = k  # topk and headtail: the exact head's width
    try:
        k = support_width(mode, k, num_samples, V)
    except ValueError as e:
        raise CaptureError(str(e)) from None
    widths = entry_widths(mode, k, head_k)
    ids = np.zeros((n, k), dtype=np.int32)
    logprobs = np.zeros((n, widths["k_head"]), dtype=np.float32) if mode != "sampled" else None
    counts = np.zeros((n, widths["k_tail"]), dtype=np.uint16) if mode in DRAWN_MODES else None
    residual = np.zeros(n, dtype=np.float32)
    realized = np.zeros(n, dtype=np.float32)
    targets = np.asarray(targets, dtype=np.int64)
    if n and int(targets.max()) >= V:  # checked on the host: no device read-back
        raise CaptureError(f"a teacher token id is >= the tokenizer's vocabulary ({V})")
    targets = torch.as_tensor(targets).to(device)
    for a in range(0, n, rows_per_block):
        b = min(n, a + rows_per_block)
        real, pad = _split_logits(rows[a:b], head, V)  # [r, V], [r, V_model - V]
        if mode in ("topk", "headtail"):
            val, idx = torch.topk(real, head_k, dim=-1, sorted=True)  # [r, K]; val[:, 0] is the row max
            m = val[:, :1]
        else:
            m = real.amax(-1, keepdim=True)
        if pad.shape[1]:
            m = torch.maximum(m, pad.amax(-1, keepdim=True))
        e = torch.exp(real - m)  # [r, V]
        total = e.sum(-1, keepdim=True)
        if pad.shape[1]:
            total = total + torch.exp(pad - m).sum(-1, keepdim=True)
        lse = m + torch.log(total)  # [r, 1]
        realized[a:b] = (real.gather(1, targets[a:b, None]) - lse)[:, 0].cpu().numpy()
        if mode == "headtail":
            residual[a:b] = _head_tail(e, total, val - lse, idx, num_samples, generator,
                                       ids[a:b], logprobs[a:b], counts[a:b])
            continue
        if mode == "topk":
            lp = val - lse
            ids[a:b] = idx.to(torch.int32).cpu().numpy()
            logprobs[a:b] = lp.cpu().numpy()
            mass = torch.exp(lp.double()).sum(-1)
        else:
            mass = (e.sum(-1).double() / total[:, 0].double())
            if mode == "full":
                ids[a:b] = np.arange(V, dtype=np.int32)
                logprobs[a:b] = (real - lse).cpu().numpy()
            else:
                draws = torch.multinomial(e, num_samples, replacement=True, generator=generator)  # [r, N]
                hist = torch.zeros_like(real, dtype=torch.int32).scatter_add_(
                    1, draws, torch.ones_like(draws, dtype=torch.int32))  # [r, V]
                cnt, idx = torch.topk(hist, min(num_samples, V), dim=-1, sorted=True)  # by count, descending
                cnt, idx = _ties_by_id(cnt, idx)
                ids[a:b, :cnt.shape[1]] = torch.where(cnt > 0, idx, 0).to(torch.int32).cpu().numpy()
                counts[a:b, :cnt.shape[1]] = cnt.to(torch.int32).cpu().numpy().astype(np.uint16)
        residual[a:b] = torch.clamp(1.0 - mass, min=0.0).float().cpu().numpy()
    return Targets(ids=ids, logprobs=logprobs, counts=counts, residual=residual, realized=realized)


def _head_tail(e, total, head_lp, head_idx, num_samples: int, generator, ids: np.ndarray, logprobs: np.ndarray,
               counts: np.ndarray) -> np.ndarray:
    """One block of headtail targets: fills ids [r, k], logprobs [r, K], counts [r, k - K] in place;
    returns R [r] (float32).

    e = exp(real - m) [r, V] over the tokenizer's ids, total [r, 1] its normaliser (padded columns
    included); head_lp, head_idx [r, K] the exact head. The tail is e with the head's columns zeroed;
    R = sum(tail) / total. Rows with R = 0 get no draws: multinomial sees them as rows of ones and
    their counts are zeroed, so no all-zero row reaches it and no row count is read back.
    """
    import torch

    K = head_idx.shape[1]
    ids[:, :K] = head_idx.to(torch.int32).cpu().numpy()
    logprobs[:] = head_lp.cpu().numpy()
    tail = e.scatter(1, head_idx, 0.0)  # [r, V]
    tail_sum = tail.sum(-1)  # [r]
    has = tail_sum > 0
    width = ids.shape[1] - K  # min(N, V - K)
    if width:
        draws = torch.multinomial(torch.where(has[:, None], tail, 1.0), num_samples, replacement=True,
                                  generator=generator)  # [r, N]
        hist = torch.zeros_like(tail, dtype=torch.int32).scatter_add_(
            1, draws, torch.ones_like(draws, dtype=torch.int32)) * has[:, None]  # [r, V]
        cnt, idx = _ties_by_id(*torch.topk(hist, width, dim=-1, sorted=True))  # by count desc, then id
        ids[:, K:] = torch.where(cnt > 0, idx, 0).to(torch.int32).cpu().numpy()
        counts[:] = cnt.to(torch.int32).cpu().numpy().astype(np.uint16)
    return (tail_sum.double() / total[:, 0].double()).float().cpu().numpy()


def _ties_by_id(cnt, idx):
    """Order entries by count descending, then id ascending (topk's order among ties is unspecified)."""
    import torch

    key = cnt.to(torch.int64) * (1 << 32) - idx.to(torch.int64)
    order = torch.argsort(key, dim=-1, descending=True)
    return cnt.gather(1, order), idx.gather(1, order)
